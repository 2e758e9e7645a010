"""Twenty JSON schemas of the shapes structured-output users send: flat and nested objects, arrays
with bounds, enums, numbers and integers with bounds, required and optional fields, anyOf, nulls,
string patterns and formats. Each comes with a prompt that asks the model for such an object.
Used by the structured-output tests and by bench_grammar."""

from __future__ import annotations

from typing import Any

SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("a person", {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                  "required": ["name", "age"]}),
    ("a city with its population", {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                         "population": {"type": "integer", "minimum": 0}},
        "required": ["city", "population"], "additionalProperties": False}),
    ("a colour", {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
                  "required": ["colour"]}),
    ("a temperature reading", {"type": "object", "properties": {
        "celsius": {"type": "number", "minimum": -90, "maximum": 60}, "station": {"type": "string"}},
        "required": ["celsius"]}),
    ("three fruits", {"type": "object", "properties": {"fruits": {
        "type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 3}}, "required": ["fruits"]}),
    ("a book with its author", {"type": "object", "properties": {
        "title": {"type": "string"}, "author": {"type": "object", "properties": {
            "first": {"type": "string"}, "last": {"type": "string"}}, "required": ["first", "last"]},
        "year": {"type": "integer", "minimum": 1000, "maximum": 2100}}, "required": ["title", "author"]}),
    ("a yes or no answer", {"type": "object", "properties": {"answer": {"type": "boolean"},
                                                             "reason": {"type": "string", "maxLength": 80}},
                            "required": ["answer"]}),
    ("a list of two points", {"type": "object", "properties": {"points": {"type": "array", "items": {
        "type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]},
        "minItems": 2, "maxItems": 2}}, "required": ["points"]}),
    ("an id that is a number or a string", {"type": "object", "properties": {
        "id": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 12}]}}, "required": ["id"]}),
    ("a product", {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "price": {"type": "number", "minimum": 0},
        "in_stock": {"type": "boolean"}}, "required": ["sku", "price", "in_stock"]}),
    ("a weekday", {"type": "object", "properties": {"day": {"enum": [
        "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]}}, "required": ["day"]}),
    ("a rating", {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                                                   "comment": {"type": ["string", "null"]}},
                  "required": ["stars", "comment"]}),
    ("a user with optional email", {"type": "object", "properties": {
        "username": {"type": "string", "minLength": 3, "maxLength": 16}, "email": {"type": "string"}},
        "required": ["username"]}),
    ("a matrix of two rows", {"type": "object", "properties": {"rows": {"type": "array", "minItems": 2, "maxItems": 2,
                                                                        "items": {"type": "array", "items": {
                                                                            "type": "integer"}, "maxItems": 3}}},
                              "required": ["rows"]}),
    ("an order", {"type": "object", "properties": {
        "order_id": {"type": "integer"}, "items": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"name": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1}},
            "required": ["name", "quantity"]}}, "status": {"enum": ["open", "shipped", "closed"]}},
        "required": ["order_id", "items", "status"]}),
    ("a shape", {"anyOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "radius": {"type": "number"}},
         "required": ["kind", "radius"]},
        {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "number"}},
         "required": ["kind", "side"]}]}),
    ("a list of tags", {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 4}),
    ("a date", {"type": "object", "properties": {"date": {"type": "string", "format": "date"}}, "required": ["date"]}),
    ("a config with nested limits", {"type": "object", "properties": {
        "name": {"type": "string"}, "limits": {"type": "object", "properties": {
            "cpu": {"type": "number", "exclusiveMinimum": 0}, "memory_mb": {"type": "integer", "minimum": 64}},
            "required": ["cpu", "memory_mb"]}, "enabled": {"type": "boolean"}},
        "required": ["name", "limits", "enabled"]}),
    ("a translation", {"type": "object", "properties": {
        "source": {"type": "string"}, "target": {"type": "string"},
        "language": {"type": "string", "enum": ["fr", "de", "es", "it"]}},
        "required": ["source", "target", "language"], "additionalProperties": False}),
]


def prompt_for(description: str) -> str:
    return f"Reply with a JSON object for {description}. Answer with JSON only."
