"""The column types of JSON data files, from every row of every file, so that `datasets` reads each value as the file
holds it.

Left to itself, `datasets` 5.2 takes a JSON file's column types from its first 10 MB (and a validation file's from the
train file) and casts the rest to them: a chat turn whose content comes in parts, past the first 10 MB or in the
validation file only, reached a recipe as its JSON text, and a message key that only some files have (`name`,
`tool_calls`, `weight`) stopped the load with "Couldn't cast". Given the types of all rows, it reads each file to them:
a column of text, numbers or booleans keeps its Arrow type; any other column (lists, objects, or values of mixed kinds)
is `datasets.Json`, each value stored as its JSON text and handed back as the file holds it (a message has exactly its
own keys; none is filled in with None).
"""

from __future__ import annotations

import json

from datasets import Features, Json, Value

from common.errors import fail

SCALARS = {(str,): Value("string"), (bool,): Value("bool"), (int,): Value("int64"), (float,): Value("float64"),
           (float, int): Value("float64")}  # JSON numbers: a column of 2 and 2.5 is a float column
LOOKS_LIKE_JSON = tuple('{["-0123456789tfn')


def json_features(files: dict[str, str]) -> Features | None:
    """The columns of the rows of `files` ({split: path}; JSON lines, or JSON documents holding a list of rows) and
    their types, or None for data that is not rows of objects, not JSON, or a later file with a column the first
    lacks: `datasets` then reads it its own way (a list of strings as `text`) or fails, and the caller names the line
    or the column.

    One line naming the file, the row and the column for text that `datasets.Json` cannot keep: in a column of mixed
    kinds, a string that is itself JSON (`"3"` among numbers) would come back as what it spells (3)."""
    kinds: dict[str, set[type]] = {}
    json_text: dict[str, tuple[str, int, str]] = {}  # column -> (split, row, value) of its first such string
    try:
        for number, (split, path) in enumerate(files.items()):
            for row, values in enumerate(json_rows(path)):
                if not isinstance(values, dict) or (number and not values.keys() <= kinds.keys()):
                    return None
                for column, value in values.items():
                    kinds.setdefault(column, set()).add(type(value))
                    if isinstance(value, str) and column not in json_text and is_json(value):
                        json_text[column] = (split, row, value)
    except (ValueError, UnicodeDecodeError):
        return None
    features = Features({column: column_type(found - {type(None)}) for column, found in kinds.items()})
    for column, (split, row, value) in json_text.items():
        if isinstance(features[column], Json):
            fail(f"--{split}_file {files[split]}: row {row + 1} has {value!r} in '{column}', text that is also JSON, "
                 f"where other rows hold {' or '.join(sorted(kind.__name__ for kind in kinds[column] - {str, type(None)}))}: "
                 "it would be read as the value it spells; give the column one kind of value")
    return features


def column_type(kinds: set[type]):
    if not kinds:
        return Value("null")
    return SCALARS.get(tuple(sorted(kinds, key=lambda kind: kind.__name__)), Json())


def is_json(text: str) -> bool:
    if not text.lstrip().startswith(LOOKS_LIKE_JSON):
        return False
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def json_rows(path: str):
    """Each row of a JSON lines file (or of a JSON document holding a list of rows) as the file holds it."""
    with open(path, encoding="utf-8-sig") as f:  # a leading byte-order mark is not the data's (datasets drops it too)
        document = f.read(1) == "["
        f.seek(0)
        yield from json.load(f) if document else (json.loads(line) for line in f if line.strip())
