"""A corpus of JSON schemas of the kinds users send (flat and nested objects, bounds, enums,
patterns, formats, anyOf, $ref, optional fields, const), shared by the corpus test and
benchmarks/structured.py."""

from __future__ import annotations

CORPUS = {
    "flat": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "name": {"type": "string"}},
                "required": ["id", "name"],
            }
        },
        "required": ["user"],
    },
    "array_bounds": {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 3},
    "enum": {"type": "string", "enum": ["low", "medium", "high"]},
    "int_bounds": {"type": "integer", "minimum": 1, "maximum": 9},
    "number": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]},
    "boolean": {"type": "boolean"},
    "pattern": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
    "date": {"type": "string", "format": "date"},
    "any_of": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}]},
    "ref_defs": {
        "$defs": {
            "pt": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/pt"}, "end": {"$ref": "#/$defs/pt"}},
        "required": ["start", "end"],
    },
    "optional": {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 20}, "year": {"type": "integer"}},
        "required": ["title"],
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"type": "string", "maxLength": 6}},
            "required": ["k"],
        },
        "maxItems": 2,
    },
    "const": {"type": "object", "properties": {"v": {"const": 1}}, "required": ["v"]},
    "string_length": {"type": "string", "minLength": 2, "maxLength": 5},
}
