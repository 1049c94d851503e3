"""`LLM.chat(chat_template_kwargs=...)`: extra variables for the chat template (vLLM's and
SGLang's field, such as Qwen3's `enable_thinking`), on the real SmolLM2 engine; the names braid
itself passes to the template are refused by name."""

from __future__ import annotations

import pytest

from braid import SamplingParams
from tests.conftest import assert_kv_all_free_or_cached

MSGS = [{"role": "user", "content": "Say hi."}]
TEMPLATE = "{% for m in messages %}<{{ m.content }}>{% endfor %}{% if shout %} LOUDLY{% endif %}"
ONE = SamplingParams(temperature=0.0, max_tokens=1)


def _prompt(llm, **kw) -> str:
    return llm.chat(MSGS, ONE, use_tqdm=False, **kw)[0].prompt


def test_template_kwargs_reach_the_template(smollm2):
    assert _prompt(smollm2, chat_template=TEMPLATE) == "<Say hi.>"
    loud = _prompt(smollm2, chat_template=TEMPLATE, chat_template_kwargs={"shout": True})
    assert loud == "<Say hi.> LOUDLY"
    # A variable the template never reads changes nothing (SmolLM2's own template has no
    # thinking switch), as in vLLM and SGLang.
    plain = _prompt(smollm2)
    assert _prompt(smollm2, chat_template_kwargs={"enable_thinking": False}) == plain


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"tokenize": True}, "chat_template_kwargs.tokenize: braid sets this argument itself"),
        ({"add_generation_prompt": False}, "use the request's add_generation_prompt field"),
        ({"messages": []}, "chat_template_kwargs.messages"),
        (["shout"], "chat_template_kwargs: must be an object"),
    ],
)
def test_names_braid_passes_itself_are_refused(smollm2, kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        smollm2.chat(MSGS, ONE, use_tqdm=False, chat_template_kwargs=kwargs)
    assert_kv_all_free_or_cached(smollm2)


def test_text_parts_of_one_message_stand_on_lines_of_their_own(smollm2):
    """A content list of text parts reaches the template joined by newlines, as vLLM joins
    them (glued together, "Line one.Line two." is another prompt)."""
    from braid.runtime.tokenizer.chat import template_messages

    parts = [{"type": "text", "text": "Line one."}, {"type": "text", "text": "Line two."}]
    (msg,), _ = template_messages([{"role": "user", "content": parts}], None)
    assert msg["content"] == "Line one.\nLine two."
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    split = smollm2.chat([{"role": "user", "content": parts}], sp, use_tqdm=False)[0]
    whole = smollm2.chat([{"role": "user", "content": "Line one.\nLine two."}], sp, use_tqdm=False)[
        0
    ]
    assert split.prompt_token_ids == whole.prompt_token_ids
