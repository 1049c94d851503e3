"""The scheduler's one home for request state: each request has one status, the queues are
views in entry order, and a rid names one request in flight."""

from __future__ import annotations

import pytest

from braid.runtime.ipc.to_scheduler import GenerateReq
from braid.runtime.sampling_params import SamplingParams
from braid.runtime.scheduler.request import Req, ReqStatus, RequestTable

EOS = frozenset({0})


def _req(rid: str) -> Req:
    return Req.from_message(GenerateReq(rid, [1, 2, 3], SamplingParams(), 0), 64, 100, EOS)


def test_each_request_has_one_status_and_views_keep_entry_order():
    t = RequestTable()
    a, b, c = _req("a"), _req("b"), _req("c")
    for r in (a, b, c):
        t.add(r, ReqStatus.WAITING)
    t.move(b, ReqStatus.RUNNING)
    t.move(a, ReqStatus.RUNNING)
    assert [r.rid for r in t.view(ReqStatus.RUNNING)] == ["b", "a"]
    assert [r.rid for r in t.view(ReqStatus.WAITING)] == ["c"]
    # A retracted request resumes first: the head of the waiting queue.
    t.move(a, ReqStatus.WAITING, front=True)
    assert [r.rid for r in t.view(ReqStatus.WAITING)] == ["a", "c"]
    assert a.status is ReqStatus.WAITING and t.count(ReqStatus.RUNNING) == 1
    assert t.count(*ReqStatus) == len(t) == 3
    assert t.first(ReqStatus.PREFILLING) is None and t.first(ReqStatus.RUNNING) is b


def test_a_finished_request_leaves_and_its_rid_is_free_again():
    t = RequestTable()
    a = _req("a")
    t.add(a, ReqStatus.COMPILING)
    assert t.get("a") is a
    t.discard(a)
    t.discard(a)  # leaving twice is nothing
    assert t.get("a") is None and len(t) == 0 and a.status is None
    t.add(_req("a"), ReqStatus.WAITING)
    assert t.get("a") is not a


def test_a_rid_in_flight_is_refused():
    t = RequestTable()
    t.add(_req("a"), ReqStatus.WAITING)
    with pytest.raises(ValueError, match="rid: 'a' is already in use"):
        t.add(_req("a"), ReqStatus.WAITING)
    assert len(t) == 1


@pytest.mark.parametrize(
    ("ids", "match"),
    [([], "at least one token"), ([1] * 64, "no room"), ([1, 100], r"token ids must be in")],
)
def test_a_bad_prompt_is_a_value_error(ids, match):
    with pytest.raises(ValueError, match=match):
        Req.from_message(GenerateReq("r", ids, SamplingParams(), 0), 64, 100, EOS)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(logit_bias={100: 1.0}),
        SamplingParams(allowed_token_ids=[1, 100]),
        SamplingParams(stop_token_ids=[100]),
        SamplingParams(bad_words_token_ids=[[3, 100]]),
    ],
)
def test_a_sampling_token_id_past_the_vocabulary_is_refused_by_the_scheduler(params):
    """The front ends check these; the scheduler does too, since a sampler index past the
    vocabulary would fail the whole step."""
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Req.from_message(GenerateReq("r", [1, 2], params, 0), 64, 100, EOS)


def test_a_cache_salt_keys_the_whole_prompt_apart():
    """vLLM's cache_salt: the prefix cache's key of the first token is salted, so a prompt
    shares cached KV only with prompts of the same salt (radix matches are prefixes)."""

    def keys(salt):
        msg = GenerateReq("r", [5, 6, 7], SamplingParams(), 0, cache_salt=salt)
        return Req.from_message(msg, 64, 100, EOS).cache_tokens()

    assert keys(None) == [5, 6, 7]
    a, b = keys("tenant-a"), keys("tenant-b")
    assert a == keys("tenant-a") and a != b and a[1:] == b[1:] == [6, 7]
    assert a[0] < 0 and b[0] < 0  # never a vocabulary id


def test_max_tokens_is_capped_by_the_context():
    sp = SamplingParams(max_tokens=1000)
    req = Req.from_message(GenerateReq("r", [1, 2, 3, 4], sp, 0), 64, 100, EOS)
    assert req.max_new_tokens == 60
