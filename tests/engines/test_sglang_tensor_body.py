"""The `/update_weights_from_tensor` body built without `json.dumps` of the base64
(`verst.rollout.engines.sglang.refit.tensor_body`) is the JSON `json.dumps` would give, and its
tensors come back exactly (`verst serve`'s decoding: base64 → pickle)."""

from __future__ import annotations

import base64
import json
import pickle

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verst.rollout.engines.sglang.refit import serialize_named_tensors, tensor_body

_fields = st.dictionaries(
    st.sampled_from(["flush_cache", "weight_version", "load_format"]),
    st.one_of(st.booleans(), st.text(max_size=8), st.none()),
    max_size=3,
)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=3), _fields)
def test_tensor_body_is_the_json_of_its_fields(payloads, fields):
    blobs = [base64.b64encode(p) for p in payloads]
    body = json.loads(tensor_body(blobs, fields))
    assert body == {**fields, "serialized_named_tensors": [b.decode() for b in blobs]}


def test_tensors_round_trip_through_the_body():
    named = {"a": torch.randn(3, 4), "b": torch.arange(5).to(torch.bfloat16)}
    body = json.loads(tensor_body([serialize_named_tensors(named, text=False)], {"flush_cache": True}))
    got = dict(pickle.loads(base64.b64decode(body["serialized_named_tensors"][0])))
    assert body["flush_cache"] is True and set(got) == set(named)
    assert all(torch.equal(got[n], named[n]) and got[n].dtype == named[n].dtype for n in named)
