"""A small Dockerfile reader: stages, their instructions, and .dockerignore matching.

Enough of the format for our own Dockerfile (line continuations, comments, JSON or shell
form, `FROM ... AS name`, `ARG` defaults in FROM); not a general parser.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    args: str  # the rest of the line, continuations joined

    def flags(self) -> dict[str, str]:
        """`--name=value` options before the arguments (COPY --from=..., --chown=...)."""
        return dict(re.findall(r"(?:^|\s)--([a-z-]+)=(\S+)", self.args))

    def words(self) -> list[str]:
        """The arguments without options: JSON (exec) form or shell words."""
        text = self.args.strip()
        if text.startswith("["):
            parsed = json.loads(text)
            assert isinstance(parsed, list)
            return [str(w) for w in parsed]
        return [w for w in shlex.split(text) if not w.startswith("--")]


@dataclass
class Stage:
    name: str
    base: str  # image reference or an earlier stage's name, ARGs substituted
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction | None:
        found = self.all(keyword)
        return found[-1] if found else None


def instructions(text: str) -> list[Instruction]:
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        out.append(Instruction(keyword.upper(), " ".join(rest.split())))
    return out


def stages(text: str) -> list[Stage]:
    """The build stages in order; ARGs declared before the first FROM are substituted."""
    args: dict[str, str] = {}
    result: list[Stage] = []
    for ins in instructions(text):
        if ins.keyword == "ARG" and not result:
            name, _, default = ins.args.partition("=")
            args[name] = default
        elif ins.keyword == "FROM":
            words = ins.args.split()
            base = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(result))
            result.append(Stage(name, base))
        elif result:
            result[-1].instructions.append(ins)
    return result


def ancestry(all_stages: list[Stage], name: str) -> list[Stage]:
    """`name` and the stages it is built FROM, nearest first."""
    by_name = {s.name: s for s in all_stages}
    chain = [by_name[name]]
    while chain[-1].base in by_name:
        chain.append(by_name[chain[-1].base])
    return chain


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Whether the build context leaves `path` out (last matching pattern wins, `!` re-includes;
    a pattern matching a directory covers what is inside it)."""
    excluded = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        pattern = pattern.strip("/")
        if _matches(pattern, path.strip("/")):
            excluded = not negate
    return excluded


def _matches(pattern: str, path: str) -> bool:
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    if pattern.startswith("**/"):
        tail = pattern[3:]
        return any(fnmatch.fnmatchcase(part, tail) for part in parts)
    return any(fnmatch.fnmatchcase(p, pattern) and p.count("/") == pattern.count("/")
               for p in prefixes)


def read_dockerignore(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
