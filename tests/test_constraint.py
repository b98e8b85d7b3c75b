"""Structured output (constraint.py): OpenAI's response_format forms, schemas from text or files, the grammar's
masks over a packed tree, and sampled answers that are the JSON their schema asks for."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mlx_redrafter import api
from mlx_redrafter.constraint import Constraint, response_format, schema_text
from mlx_redrafter.errors import UserError

FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
        "additionalProperties": False}


def test_response_format_forms_and_one_line_errors(tmp_path):
    assert response_format(None) is None and response_format({"type": "text"}) is None
    assert json.loads(response_format({"type": "json_object"})) == {"type": "object"}
    assert json.loads(response_format({"type": "json_schema", "json_schema": {"name": "f", "schema": FLAG}})) == FLAG
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(FLAG))
    assert schema_text(str(path)) == schema_text(json.dumps(FLAG)) == schema_text(FLAG)
    for bad, needle in (({"type": "xml"}, "response_format must be"), ([1], "response_format must be"),
                        ({"type": "json_schema"}, "needs \"json_schema\"")):
        with pytest.raises(UserError, match=needle):
            response_format(bad)
    (tmp_path / "list.json").write_text("[1]")
    for bad, needle in (("{nope", "not valid JSON"), ("[1]", "must be a JSON schema object"),
                        (str(tmp_path / "list.json"), "holds a JSON array"), (str(tmp_path / "no"), "does not exist"),
                        ("[" * 100000, "not valid JSON")):
        with pytest.raises(UserError, match=needle):
            schema_text(bad)
    with pytest.raises(UserError, match="not usable"):
        api.decode_options(json_schema={"type": "objec"})


def test_a_tree_node_is_masked_by_its_own_path(target):
    tok, vocab = target.tokenizer, target.model.args.vocab_size
    ids = tok.encode('{"ok": true}')
    c = Constraint(schema_text(FLAG), tok, vocab)
    alone = Constraint(schema_text(FLAG), tok, vocab)
    alone.advance(ids[:1])
    after_first = np.array(alone.allowed()[0])
    forbidden = tok.encode("hello")[0]
    rows = np.array(c.allowed_tree([ids[0], ids[0], forbidden, ids[1]], [-1, 0, 0, 1]))
    start = np.array(c.allowed()[0])
    assert (rows[0] == start).all() and not start[forbidden]  # the root: the state the sequence is in
    assert (rows[1] == after_first).all()  # after its own path
    assert rows[2].all()  # a node the grammar forbids is never accepted: its row is never read
    assert rows[3].sum() < vocab
    c.advance(ids)
    assert set(np.flatnonzero(np.array(c.allowed()[0]))) == set(tok.eos_ids)  # complete: only the end may follow


def test_sampled_answers_are_the_json_their_schema_asks_for(target):
    drafter, name = api.resolve_drafter("default", target)
    lm = api.LoadedModel(target, drafter, name)
    for seed in range(3):
        r = api.generate(lm, "Is the sky blue? Answer in JSON.", max_tokens=24, temperature=1.0, seed=seed,
                         json_schema=FLAG)
        assert r.stats.stop_reason == "eos" and set(json.loads(r.text)) == {"ok"}, r.text


def test_what_the_grammar_forces_is_drafted_and_verified_in_one_call(target):
    drafter, name = api.resolve_drafter("default", target)
    lm = api.LoadedModel(target, drafter, name)
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    ar = api.generate(lm, "Where is the Eiffel Tower?", max_tokens=32, draft="none", json_schema=schema)
    fast = api.generate(lm, "Where is the Eiffel Tower?", max_tokens=32, json_schema=schema)
    assert fast.tokens == ar.tokens and set(json.loads(ar.text)) == {"city", "country"}
    assert fast.stats.source_runs["grammar"] >= 3  # '{"city": "' and '", "country": "' came as forced drafts
