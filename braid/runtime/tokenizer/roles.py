"""Role boundaries of a chat template as plain strings, so that a program can build its prompt
text piece by piece (`with s.user(): ...`) and get exactly what the template renders.

The template is rendered around a sentinel message: what comes before the sentinel is the role's
prefix, what follows is its suffix. The first message of a conversation gets its own prefix (a
template may open with BOS or insert a default system prompt there)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

_SENTINEL = "BRAIDROLESENTINEL7Q"
_ROLES = ("system", "user", "assistant")
_CONTEXTS = (
    [{"role": "system", "content": "A"}],
    [{"role": "user", "content": "A"}],
    [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}],
)


@dataclass(frozen=True)
class RoleTemplate:
    """`first[role]` opens a conversation with `role`; `prefix[role]` opens a later message;
    `suffix[role]` closes one."""

    first: dict[str, str] = field(default_factory=dict)
    prefix: dict[str, str] = field(default_factory=dict)
    suffix: dict[str, str] = field(default_factory=dict)

    def begin(self, role: str, first: bool) -> str:
        return (self.first if first else self.prefix)[role]

    def end(self, role: str) -> str:
        return self.suffix[role]

    def to_dict(self) -> dict[str, dict[str, str]]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RoleTemplate:
        return cls(dict(d["first"]), dict(d["prefix"]), dict(d["suffix"]))

    @classmethod
    def plain(cls) -> RoleTemplate:
        """For models without a chat template: `User: ...` lines."""
        pre = {r: f"{r.capitalize()}: " for r in _ROLES}
        return cls(dict(pre), dict(pre), {r: "\n" for r in _ROLES})


def role_template(tokenizer) -> RoleTemplate:
    """The role boundaries of `tokenizer`'s chat template (`RoleTemplate.plain()` if it has
    none). A role the template refuses (e.g. no system role) is left out: using it in a program
    is then an error that names the role."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return RoleTemplate.plain()

    def render(messages: list[dict[str, str]]) -> str | None:
        try:
            return tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=False
            )
        except Exception:  # jinja raises many types for conversations a template refuses
            return None

    first, prefix, suffix = {}, {}, {}
    for role in _ROLES:
        alone = render([{"role": role, "content": _SENTINEL}])
        if alone is None or alone.count(_SENTINEL) != 1:
            continue
        first[role], suffix[role] = alone.split(_SENTINEL)
        for ctx in _CONTEXTS:
            before = render(ctx)
            after = render(ctx + [{"role": role, "content": _SENTINEL}])
            if before is None or after is None or not after.startswith(before):
                continue
            pre, suf = after[len(before) :].split(_SENTINEL)
            prefix[role] = pre
            suffix[role] = suf
            break
        else:
            prefix[role] = first[role]
    return RoleTemplate(first, prefix, suffix)
