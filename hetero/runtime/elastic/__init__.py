"""Elastic runs (``hetero launch --elastic``): devices that leave or join while training goes on.

The modules depend one way, from the top of this list down; none imports one above it:

- the launcher's side, which decides: :mod:`.run` (the run from attempt to attempt; a lost device's
  state through the run directory and a restart where the in-process path does not apply),
  :mod:`.live` (:class:`~.live.LiveRun`, the in-process controller), :mod:`.joiners` (the processes
  of devices that join), :mod:`.watch` (changes of the cluster file, planned for while training
  goes on); over several machines (``--node-rank``) the other machines' launchers, :mod:`.agent`,
  which the controller sees through :mod:`.remote`;
- what those decisions are made of: :mod:`.policy` (what is refused, when to give up, the
  replanning), :mod:`.plans` (the plan running now, one made ahead, which survivor takes which rank),
  :mod:`.report` (the reconfigurations table);
- :mod:`.processes`: the launcher starts every worker of the in-process path itself;
- the workers' side, which reshards: :mod:`.reconfig` (:class:`~.reconfig.LiveReconfig`, a
  worker surviving a lost peer or pausing for a change) and :mod:`.joining` (a worker that joins),
  over the mechanism in :mod:`hetero.runtime.reshard`;
- :mod:`.protocol`: what both sides agree on (environment variables, store keys, the pause request,
  the lost-peer signal), importing nothing.

This package module imports none of them: a worker that needs :mod:`.protocol` does not load the
launcher's controller.
"""
