"""What a prompt's token ids must be for the scheduler to take them: not empty, within the
context (room for one generated token at least, unless it is embedded), inside the vocabulary.
The front end checks them before it submits (`TokenizerManager.validate`)."""

from __future__ import annotations

from braid.runtime.errors import ParamError


def check_prompt_ids(
    input_ids: list[int], context_length: int, vocab_size: int, where: str, embed: bool
) -> None:
    """A `ParamError` naming `where` (the prompt's field) for ids the scheduler would refuse
    (`embed`: an embedding request, which may fill the whole context)."""
    if not input_ids:
        raise ParamError.at(where, "the prompt is empty")
    if embed and len(input_ids) > context_length:
        raise ParamError.at(
            where, f"{len(input_ids)} tokens is longer than the context length ({context_length})"
        )
    if not embed and len(input_ids) >= context_length:
        raise ParamError.at(
            where,
            f"{len(input_ids)} tokens is longer than the context length allows "
            f"({context_length} tokens in all, at least one of them generated)",
        )
    bad = [t for t in input_ids if not 0 <= t < vocab_size]
    if bad:
        raise ParamError.at(where, f"token id {bad[0]} is outside the vocabulary ({vocab_size})")


def check_names(**names: str | None) -> None:
    """A `ParamError` naming the field for a name given that is not a non-empty string, or a
    `session_id` that begins with "." (the part before its first "." names its program,
    which `/end_program` and `/close_session` must be able to name)."""
    for field, value in names.items():
        if value is not None and (not isinstance(value, str) or not value):
            raise ParamError(field, f"{field} must be a non-empty string, got {value!r}")
    session = names.get("session_id")
    if session is not None and session.startswith("."):
        raise ParamError(
            "session_id",
            f"session_id {session!r} begins with '.': the part before its first '.' names "
            "its program, so it must not be empty",
        )
