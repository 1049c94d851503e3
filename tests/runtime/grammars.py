"""Grammars and instances the grammar tests share: an arithmetic grammar and a SQL subset in
EBNF (GBNF: rules with `::=`, root rule `root`) and Lark, a structural tag for a tool call in
free text, SGLang's character regex (tests/data/sglang) with a record it matches, and one valid
instance of each schema of the JSON corpus."""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data"

ARITHMETIC = r"""
root ::= expr " = " num
expr ::= num (" " op " " num)*
op ::= "+" | "-" | "*" | "/"
num ::= [0-9] | [1-9] [0-9] | [1-9] [0-9] [0-9]
"""

SQL = r"""
root ::= "SELECT " columns " FROM " table where? ";"
columns ::= column (", " column)*
column ::= "id" | "name" | "age" | "email"
table ::= "users" | "orders"
where ::= " WHERE " column " " cmp " " value
cmp ::= "=" | ">" | "<"
value ::= [0-9]+ | "'" [a-z]+ "'"
"""

# What ARITHMETIC and SQL match, as Python regexes (to check outputs with), and a prompt that
# makes a model write such arithmetic.
COLUMN = "(id|name|age|email)"
SQL_RE = (
    rf"SELECT {COLUMN}(, {COLUMN})* FROM (users|orders)"
    rf"( WHERE {COLUMN} (=|>|<) ([0-9]+|'[a-z]+'))?;"
)
NUM = "([0-9]|[1-9][0-9]|[1-9][0-9][0-9])"
ARITHMETIC_RE = rf"{NUM}( [-+*/] {NUM})* = {NUM}"
MATH_PROMPT = "2 + 3 = 5\n10 - 4 = 6\n7 * 3 = 21\n"

SQL_LARK = r"""
start: "SELECT " columns " FROM " table where? ";"
columns: column (", " column)*
column: "id" | "name" | "age" | "email"
table: "users" | "orders"
where: " WHERE " column " " CMP " " value
CMP: "=" | ">" | "<"
value: /[0-9]+/ | /'[a-z]+'/
"""

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL_TAG = {
    "structures": [{"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"}],
    "triggers": ["<function="],
}

CHARACTER_REGEX = (DATA / "sglang" / "character_regex.txt").read_text().rstrip("\n")
CHARACTER = """{
    "name": "Harry Potter",
    "house": "Gryffindor",
    "blood status": "Half-blood",
    "occupation": "student",
    "wand": {
        "wood": "Holly",
        "core": "Phoenix feather",
        "length": 11.0
    },
    "alive": "Alive",
    "patronus": "Stag",
    "bogart": "Dementor"
}"""

# One instance of each schema in tests/runtime/json_schemas.py, as json.dumps writes it.
INSTANCES = {
    "flat": {"a": "hello"},
    "nested": {"user": {"id": 3, "name": "Bo"}},
    "array_bounds": ["x", "yy"],
    "enum": "medium",
    "int_bounds": 7,
    "number": {"x": -1.5},
    "boolean": True,
    "pattern": "ABC-12",
    "date": "2024-01-31",
    "any_of": 42,
    "ref_defs": {"start": {"x": 1, "y": 2}, "end": {"x": 3, "y": 4}},
    "optional": {"title": "Dune", "year": 1965},
    "array_of_objects": [{"k": "ab"}],
    "const": {"v": 1},
    "string_length": "abc",
}
