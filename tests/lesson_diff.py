"""The diff between two lesson scripts, as a README shows it in a ```diff block after
<!-- diff: A B -->. tests/test_readmes.py checks the block: its two header lines, then any of the
real diff's hunks (each one whole, unchanged, in order); a README may leave hunks out.

    python tests/lesson_diff.py 00_single_process/single_process.py 02_ddp_spawn/ddp_spawn.py
    python tests/lesson_diff.py --refresh 06_collectives/README.md   # after editing a lesson

--refresh rewrites each diff block of a README with today's hunks most like the ones it shows,
so the README keeps the hunks it chose.
"""
import difflib
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def lesson_diff(before, after, context=1):
    """Unified diff with `context` lines around each change; paths as given, relative to the repo."""
    before, after = Path(before), Path(after)
    name = lambda p: p.resolve().relative_to(REPO).as_posix() if p.resolve().is_relative_to(REPO) else p.name  # noqa: E731
    lines = difflib.unified_diff(before.read_text().splitlines(), after.read_text().splitlines(),
                                 name(before), name(after), n=context, lineterm="")
    return "".join(line + "\n" for line in lines)


def split_hunks(diff):
    """(the two header lines, [hunk, ...]); a hunk is its '@@' line and the lines up to the next."""
    lines = diff.splitlines(keepends=True)
    header, hunks = "".join(lines[:2]), []
    for line in lines[2:]:
        if line.startswith("@@"):
            hunks.append("")
        if hunks:
            hunks[-1] += line
    return header, hunks


def kept_fraction(before, after):
    """The share of `before`'s lines that `after` keeps unchanged, in order."""
    a, b = Path(before).read_text().splitlines(), Path(after).read_text().splitlines()
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    return sum(block.size for block in matcher.get_matching_blocks()) / len(a)


def refresh(readme):
    """Each `<!-- diff: A B -->` block of `readme` rewritten with today's hunks (see the docstring).
    A shown hunk is matched to today's hunk most like it (not by line number: an edit above it in
    either lesson moves it); one with no match at all stops the refresh with its first line."""
    def block(match):
        header, hunks = split_hunks(lesson_diff(REPO / match.group(1), REPO / match.group(2)))
        kept = []
        for shown in split_hunks(match.group(3))[1]:
            body = lambda hunk: hunk.split("\n", 1)[1]  # noqa: E731 (without its @@ line)
            score, best = max((difflib.SequenceMatcher(None, body(shown), body(h)).ratio(), h)
                              for h in hunks)
            if score < 0.5:
                raise SystemExit(f"{readme}: no hunk of today's diff is like {shown.splitlines()[0]}")
            kept += [best] if best not in kept else []
        kept.sort(key=hunks.index)
        return f"{match.group(0).split(chr(10))[0]}\n```diff\n{header}{''.join(kept)}```"
    pattern = r"<!--\s*diff:\s*(\S+)\s+(\S+)\s*-->\n```diff\n(.*?)```"
    readme.write_text(re.sub(pattern, block, readme.read_text(), flags=re.S))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--refresh":
        sys.exit(refresh(REPO / sys.argv[2]))
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.stdout.write(lesson_diff(REPO / sys.argv[1], REPO / sys.argv[2]))
