#!/usr/bin/env python3
"""Checks the relative links of the project's Markdown files: every linked file exists, and every
`#anchor` names a heading of its target as GitHub spells it (lower case, punctuation dropped,
spaces as hyphens, a repeated heading numbered -1, -2, ...). External links are not followed.
Also checks that no inline code in a table row holds an unescaped `|`: GitHub splits the cell
there (a spec such as `kvzip:0.1|passes=1` must be written `kvzip:0.1\\|passes=1` in a table).

Usage: check_links.py ROOT            every *.md below ROOT (hidden, build and node_modules
                                      folders and test fixtures left out)
       check_links.py --files F...    only these files
Prints one line per problem (file:line: what) and exits 1 if there is any, 0 otherwise."""

import os
import re
import sys

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
CODE = re.compile(r"`[^`]*`")
BARE_PIPE = re.compile(r"(?<!\\)\|")
SKIP_DIRS = {"node_modules", "fixtures"}


def slug(heading):
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def prose_lines(path):
    """(line number, line) of `path` outside fenced code blocks."""
    fenced = False
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif not fenced:
                yield number, line


def anchors(path, cache={}):
    if path not in cache:
        found, seen = set(), {}
        for _, line in prose_lines(path):
            m = HEADING.match(line)
            if m:
                s = slug(m.group(1))
                n = seen.get(s, 0)
                seen[s] = n + 1
                found.add(s if n == 0 else f"{s}-{n}")
        cache[path] = found
    return cache[path]


def check(path):
    """(broken links, split table cells) of `path`, one line each, from one pass over it."""
    links, cells = [], []
    for number, line in prose_lines(path):
        if line.lstrip().startswith("|"):
            cells += [f"{path}:{number}: unescaped | in inline code splits a table cell: "
                      f"{m.group()}" for m in CODE.finditer(line) if BARE_PIPE.search(m.group())]
        for m in LINK.finditer(line):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) \
                if file_part else path
            if not os.path.exists(dest):
                links.append(f"{path}:{number}: missing file {target}")
            elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
                links.append(f"{path}:{number}: no heading for #{anchor} in {dest}")
    return links, cells


def markdown_files(root):
    for top, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and not d.startswith("build")
                         and d not in SKIP_DIRS
                         and not os.path.exists(os.path.join(top, d, "CMakeCache.txt")))
        for name in sorted(files):
            if name.endswith(".md"):
                yield os.path.join(top, name)


def main(argv):
    if len(argv) >= 2 and argv[0] == "--files":
        files = argv[1:]
    elif len(argv) == 1:
        files = list(markdown_files(argv[0]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    found = [check(f) for f in files]
    links = [p for f_links, _ in found for p in f_links]
    cells = [p for _, f_cells in found for p in f_cells]
    for p in links + cells:
        print(p)
    print(f"{len(files)} Markdown files, {len(links)} broken links, {len(cells)} split table cells")
    return 1 if links or cells else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
