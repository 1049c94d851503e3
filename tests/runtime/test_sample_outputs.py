"""`SampleOutputs`, the one accumulator of a sample's `StrOut`s that the server, `LLM` and the
language's engine backend share: texts and tokens concatenate in order, logprobs append, the
prompt's logprobs and the token texts are kept, counts are the latest, and the finish carries
its reasons; reading the outputs merged (as a lagging reader gets them) gathers the same."""

from __future__ import annotations

import copy

from braid.runtime.ipc.to_detokenizer import Refusal, SpecUsage, TokenLogprob
from braid.runtime.ipc.to_tokenizer import StrOut, merge_str_outs
from braid.runtime.outputs import SampleOutputs

LP = [TokenLogprob(5, -0.5, 1, [(5, -0.5), (9, -1.2)]), TokenLogprob(7, -0.1, 1, [(7, -0.1)])]
PROMPT_LP = [None, TokenLogprob(3, -2.0, 4, [(8, -0.3)])]


def _outs() -> list[StrOut]:
    return [
        StrOut("r", "He", [5], 2, 1, 1, logprobs=[LP[0]], prompt_logprobs=PROMPT_LP,
               token_texts={5: "He", 9: "X", 3: "a", 8: "b"}),
        StrOut("r", "", [7], 2, 2, 1, logprobs=[LP[1]], token_texts={7: "llo"}),  # held back
        StrOut("r", "llo", [], 2, 2, 1),
        StrOut("r", "!", [11], 2, 3, 1, "stop", "!", spec=SpecUsage(2, 4, 1)),
    ]  # fmt: skip


def test_outputs_gather_in_order_and_the_finish_ends_the_sample():
    s = SampleOutputs()
    for i, out in enumerate(_outs()):
        assert not s.finished, i
        s.add(out)
    assert s.finished and (s.text, s.token_ids) == ("Hello!", [5, 7, 11])
    assert s.logprobs == LP and s.prompt_logprobs == PROMPT_LP
    assert s.token_texts == {5: "He", 9: "X", 3: "a", 8: "b", 7: "llo"}
    assert (s.prompt_tokens, s.completion_tokens, s.cached_tokens) == (2, 3, 1)
    assert (s.finish_reason, s.stop_reason, s.error, s.refused) == ("stop", "!", None, None)
    assert s.spec == SpecUsage(2, 4, 1)


def test_a_refused_sample_keeps_its_error_and_the_field_it_names():
    s = SampleOutputs()
    s.add(StrOut("r", "", [], 4, 0, 0, "abort", error="regex: bad", refused=Refusal("regex")))
    assert s.finished and s.error == "regex: bad" and s.refused == Refusal("regex")
    assert s.text == "" and s.token_ids == [] and s.logprobs == []


def test_outputs_read_merged_gather_the_same_as_read_one_by_one():
    one_by_one, merged = SampleOutputs(), SampleOutputs()
    for out in _outs():
        one_by_one.add(copy.deepcopy(out))
    first, *rest = [copy.deepcopy(o) for o in _outs()]
    for out in rest[:2]:
        first = merge_str_outs(first, out)
    merged.add(first)
    merged.add(rest[2])
    assert merged == one_by_one
