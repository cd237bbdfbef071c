"""torchrun whose rendezvous store listens on the loopback interface only.

torchrun's static rendezvous opens its store server (a ``TCPStore``) on every interface
(``*:port``), and torch offers no bind address for it. A local launch must not be reachable from
the network, so the node launcher of slot 0 runs this module in place of ``torch.distributed.run``:
it binds a socket to ``--master-addr`` (127.0.0.1) and ``--master-port`` itself, starts the store
server on that socket (``TCPStore(master_listen_fd=...)``, multi-tenant), then runs torchrun in
this process. torchrun's rendezvous asks for a multi-tenant store on the same port and gets the
running server instead of binding a new one (torch keeps one server per port per process).

    python -m hetero.runtime.torchrun_loopback <torchrun arguments>
"""
from __future__ import annotations

import socket
import sys


def master_endpoint(argv: list[str]) -> tuple[str, int]:
    """(``--master-addr``, ``--master-port``) of a torchrun argument list (``--x=v`` or ``--x v``)."""
    found: dict[str, str] = {}
    for i, arg in enumerate(argv):
        for name in ("--master-addr", "--master-port", "--master_addr", "--master_port"):
            key = name.replace("_", "-")
            if arg.startswith(name + "="):
                found[key] = arg.split("=", 1)[1]
            elif arg == name and i + 1 < len(argv):
                found[key] = argv[i + 1]
    if "--master-addr" not in found or "--master-port" not in found:
        raise SystemExit("torchrun_loopback: give --master-addr and --master-port")
    return found["--master-addr"], int(found["--master-port"])


def bind_store(addr: str, port: int):
    """A multi-tenant store server listening on ``addr:port`` only (kept alive by the caller)."""
    from torch.distributed import TCPStore

    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((addr, port))
    sock.listen(128)
    store = TCPStore(addr, port, is_master=True, multi_tenant=True, master_listen_fd=sock.fileno(),
                     wait_for_workers=False)
    return store, sock


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    keep = bind_store(*master_endpoint(argv))  # noqa: F841 - the server lives as long as this process
    from torch.distributed.run import main as torchrun

    torchrun(argv)


if __name__ == "__main__":
    main()
