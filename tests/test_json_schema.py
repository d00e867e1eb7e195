"""JSON schemas as vLLM's strict mode compiles them: no properties a schema does not list unless it says so, at
every nesting level, and integers bounded — checked through the real compiler (llguidance on a byte-level
tokenizer) by which texts a sequence's matcher accepts."""

from __future__ import annotations

import pytest

from jaxserve.sampling_params import GuidedDecodingParams
from jaxserve.structured_output.grammar import GrammarCompiler
from jaxserve.structured_output.json_schema import INTEGER_LIMIT, strict_json_schema
from tests.conftest import save_tiny_tokenizer

VOCAB = 300
CITY = {"type": "object", "properties": {"name": {"type": "string"}, "size": {"type": "integer"}},
        "required": ["name"]}


@pytest.fixture(scope="module")
def compiler(tmp_path_factory) -> GrammarCompiler:
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("tokenizer"))
    save_tiny_tokenizer(path, VOCAB)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return GrammarCompiler(tokenizer, VOCAB, {tokenizer.eos_token_id})


def accepts(compiler: GrammarCompiler, schema: dict | str, text: str) -> bool:
    """Whether `text` is a whole answer the schema's grammar allows."""
    matcher = compiler.matcher(GuidedDecodingParams(json=schema))
    tokens = compiler._hf_tokenizer.encode(text)
    return all(matcher.consume_token(t) for t in tokens) and not matcher.is_error() and matcher.is_accepting()


def test_top_level_object_allows_only_its_properties(compiler):
    assert accepts(compiler, CITY, '{"name": "Paris", "size": 2}')
    assert accepts(compiler, CITY, '{"name": "Paris"}')
    assert not accepts(compiler, CITY, '{"name": "Paris", "country": "France"}')
    assert not accepts(compiler, CITY, '{"name": "Paris", "size": 2, "capital": true}')


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "object", "properties": {"city": CITY}, "required": ["city"]},
     '{"city": {"name": "Oslo"}}', '{"city": {"name": "Oslo", "x": 1}}'),
    ({"type": "array", "items": CITY}, '[{"name": "A"}, {"name": "B"}]', '[{"name": "A"}, {"name": "B", "x": 1}]'),
    ({"type": "object", "properties": {"cities": {"type": "array", "items": {"$ref": "#/$defs/City"}}},
      "$defs": {"City": CITY}}, '{"cities": [{"name": "A"}]}', '{"cities": [{"name": "A", "x": 1}]}'),
    ({"type": "object", "properties": {"place": {"anyOf": [CITY, {"type": "null"}]}}},
     '{"place": {"name": "A"}}', '{"place": {"name": "A", "x": 1}}'),
    ({"type": "array", "prefixItems": [CITY]}, '[{"name": "A"}]', '[{"name": "A", "x": 1}]'),
])
def test_nested_objects_allow_only_their_properties(compiler, schema, good, bad):
    assert accepts(compiler, schema, good)
    assert not accepts(compiler, schema, bad)


def test_a_recursive_ref_is_strict_at_every_depth(compiler):
    node = {"type": "object", "properties": {"v": {"type": "integer"},
                                             "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}}
    assert accepts(compiler, node, '{"v": 1, "next": {"v": 2, "next": null}}')
    assert not accepts(compiler, node, '{"v": 1, "next": {"v": 2, "w": 3}}')


def test_explicit_additional_properties_keep_their_meaning(compiler):
    open_city = {**CITY, "additionalProperties": True}
    assert accepts(compiler, open_city, '{"name": "A", "country": "B"}')
    typed = {**CITY, "additionalProperties": {"type": "integer"}}
    assert accepts(compiler, typed, '{"name": "A", "rank": 3}')
    assert not accepts(compiler, typed, '{"name": "A", "rank": "x"}')
    nested_open = {"type": "object", "properties": {"meta": {"type": "object", "properties": {},
                                                             "additionalProperties": True}}}
    assert accepts(compiler, nested_open, '{"meta": {"anything": [1, 2]}}')
    assert not accepts(compiler, nested_open, '{"meta": {}, "other": 1}')


def test_free_form_objects_stay_free(compiler):
    assert accepts(compiler, {"type": "object"}, '{"a": 1, "b": [true]}')
    assert accepts(compiler, {"type": "object", "properties": {"m": {"type": "object"}}}, '{"m": {"k": "v"}}')


def test_all_of_members_are_merged_not_closed(compiler):
    schema = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]}
    assert accepts(compiler, schema, '{"a": 1, "b": 2}')


def test_a_property_named_like_a_keyword_is_a_property(compiler):
    schema = {"type": "object", "properties": {"properties": {"type": "string"}, "items": {"type": "integer"}}}
    assert list(strict_json_schema(schema)["properties"]) == ["properties", "items"]
    assert accepts(compiler, schema, '{"properties": "x", "items": 3}')


def test_integers_are_bounded_to_18_digits(compiler):
    integer = {"type": "integer"}
    assert accepts(compiler, integer, str(INTEGER_LIMIT)) and accepts(compiler, integer, str(-INTEGER_LIMIT))
    assert not accepts(compiler, integer, "1" * 19)
    assert accepts(compiler, {"type": "integer", "minimum": 0}, "123")
    assert not accepts(compiler, {"type": "integer", "minimum": 0}, "1" * 19)
    assert strict_json_schema({"type": "integer", "minimum": 10**18}) == {"type": "integer", "minimum": 10**18}
    assert strict_json_schema({"type": "integer", "maximum": -10**18}) == {"type": "integer", "maximum": -10**18}
    assert accepts(compiler, {"type": "number"}, "6.02e23")  # numbers are not bounded


def test_schema_text_is_parsed_and_the_input_is_not_modified():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}}}}
    before = repr(schema)
    strict = strict_json_schema(schema)
    assert repr(schema) == before
    assert strict["additionalProperties"] is False and strict["properties"]["a"]["additionalProperties"] is False
    assert strict_json_schema('{"properties": {}}') == {"properties": {}, "additionalProperties": False}
    with pytest.raises(ValueError, match="not a valid JSON schema"):
        strict_json_schema("{not json")
    with pytest.raises(ValueError, match="not a valid JSON schema"):
        strict_json_schema("[1]")
