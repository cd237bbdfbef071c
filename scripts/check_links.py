"""Check the relative links of README.md and docs/*.md: every linked file exists, and every
``#anchor`` into a Markdown file names one of its headings (GitHub's heading slugs, a repeated
heading getting ``-1``, ``-2``...). Code spans and fenced blocks are skipped; links with a scheme
(``https:``) are not fetched. Run from the repository root: ``python scripts/check_links.py``; it
prints each broken link and exits 1 if there is any."""
import glob
import os
import re
import sys


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: str) -> set[str]:
    """Every heading anchor of the Markdown file ``path``."""
    out, seen, fenced = set(), {}, False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("```"):
                fenced = not fenced
                continue
            m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
            if m:
                base = slug(m.group(1))
                n = seen.get(base, 0)
                seen[base] = n + 1
                out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: str) -> list[str]:
    """``path: what is wrong`` for each broken relative link of the Markdown file ``path``."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    text = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", text, flags=re.S))
    out = []
    for m in re.finditer(r"\]\(([^)\s]+)\)", text):
        link = m.group(1)
        if re.match(r"^[a-z]+:", link):
            continue
        target, _, frag = link.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), target)) if target else path
        if not os.path.exists(dest):
            out.append(f"{path}: {link}: no such file")
        elif frag and dest.endswith(".md") and frag not in anchors(dest):
            out.append(f"{path}: {link}: no heading with that anchor")
    return out


def main() -> int:
    files = ["README.md"] + sorted(glob.glob("docs/*.md"))
    bad = [b for f in files for b in broken_links(f)]
    print("\n".join(bad + [f"{len(bad)} broken link(s) in {len(files)} files"]))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
