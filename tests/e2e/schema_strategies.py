"""Hypothesis strategies from the JSON Schemas of a live OpenAPI document: request bodies that fit
the schema (so the fuzzer reaches the handlers) and bodies that break it (so it reaches the
validation). Covers the keywords pydantic emits. Used by tests/e2e/test_fuzz_api.py."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

MAX_TEXT = 24  # characters of a generated string
MAX_ITEMS = 3  # items of a generated array or free-form object

JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=MAX_TEXT),
)
ANY_JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=MAX_ITEMS),
        st.dictionaries(st.text(max_size=8), inner, max_size=MAX_ITEMS),
    ),
    max_leaves=12,
)


class SchemaStrategies:
    """Strategies for the schemas of one OpenAPI document (`$ref`s into its components)."""

    def __init__(self, openapi: dict[str, Any]) -> None:
        self.components = openapi.get("components", {}).get("schemas", {})

    def fitting(self, schema: Any) -> st.SearchStrategy:
        """Values that fit `schema`."""
        if schema is True or schema == {}:
            return ANY_JSON
        if "$ref" in schema:
            name = schema["$ref"].rsplit("/", 1)[-1]
            return st.deferred(lambda: self.fitting(self.components[name]))
        if "const" in schema:
            return st.just(schema["const"])
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        for key in ("anyOf", "oneOf"):
            if key in schema:  # sibling keywords (a documented range) apply to every branch
                siblings = {k: v for k, v in schema.items() if k != key}
                return st.one_of([self.fitting({**siblings, **sub}) for sub in schema[key]])
        kind = schema.get("type")
        if isinstance(kind, list):
            return st.one_of([self.fitting({**schema, "type": k}) for k in kind])
        return self._typed(schema, kind)

    def _typed(self, schema: dict[str, Any], kind: str | None) -> st.SearchStrategy:
        if kind == "string":
            return st.text(min_size=schema.get("minLength", 0), max_size=MAX_TEXT)
        if kind == "integer":
            low = schema.get("minimum", schema.get("exclusiveMinimum", -(2**70) - 1) + 1)
            high = schema.get("maximum", schema.get("exclusiveMaximum", 2**70 + 1) - 1)
            return st.integers(low, high)
        if kind == "number":
            low = schema.get("minimum", schema.get("exclusiveMinimum"))
            return st.floats(
                low,
                schema.get("maximum"),
                exclude_min="exclusiveMinimum" in schema,
                allow_nan=False,
                allow_infinity=False,
            )
        if kind == "boolean":
            return st.booleans()
        if kind == "null":
            return st.none()
        if kind == "array":
            items = self.fitting(schema.get("items", True))
            low = schema.get("minItems", 0)
            return st.lists(items, min_size=low, max_size=max(low, MAX_ITEMS))
        if kind == "object" or "properties" in schema:
            return self._object(schema)
        return ANY_JSON

    def _object(self, schema: dict[str, Any]) -> st.SearchStrategy:
        properties = schema.get("properties", {})
        if not properties:  # a map: its values fit additionalProperties (any JSON by default)
            values = self.fitting(schema.get("additionalProperties", True))
            return st.dictionaries(st.text(max_size=8), values, max_size=MAX_ITEMS)
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {name: self.fitting(sub) for name, sub in properties.items() if name in required},
            optional={
                name: self.fitting(sub) for name, sub in properties.items() if name not in required
            },
        )

    def breaking(self, schema: Any) -> st.SearchStrategy:
        """Bodies that (mostly) do not fit: any JSON, a fitting object with one field replaced by
        any JSON, or bytes that are not JSON at all (returned as bytes)."""
        fitting = self.fitting(schema)

        @st.composite
        def one_field_broken(draw) -> Any:
            body = draw(fitting)
            if not isinstance(body, dict) or not body:
                return draw(ANY_JSON)
            return {**body, draw(st.sampled_from(sorted(body))): draw(ANY_JSON)}

        not_json = st.one_of(
            st.binary(max_size=64),
            ANY_JSON.map(lambda value: json.dumps(value)[:-1].encode() or b"{"),  # cut short
        )
        return st.one_of(ANY_JSON, one_field_broken(), not_json)
