"""The config reference, generated from disttrain/config/: its field comments are the source.

  python -m disttrain.config_reference          # the reference as Markdown, on stdout

A field's documentation is the comment block directly above it plus the comment after it on
its line; a group (a dataclass-typed field) is documented by its class docstring. The docs site
renders `markdown()` into docs/reference/config.md at build time (docs/hooks.py), and
tests/test_docs.py fails when a field has no comment or the docs name a field that does not exist.
"""

import ast
import dataclasses
import inspect
import io
import sys
import tokenize
import typing

from disttrain import config as config_lib


@dataclasses.dataclass(frozen=True)
class Field:
  path: str  # dotted, as --config.<path>=VALUE sets it
  type: str
  default: typing.Any
  doc: str


def _comments(source: str) -> dict[int, str]:
  """Line number -> the text of the comment on that line."""
  return {tok.start[0]: tok.string.lstrip('#').strip()
          for tok in tokenize.generate_tokens(io.StringIO(source).readline)
          if tok.type == tokenize.COMMENT}


def _field_docs(cls: type) -> dict[str, str]:
  """Field name -> its comment block above and its comment on the line (class `cls`, read from
  the source of its own module)."""
  source = inspect.getsource(sys.modules[cls.__module__])
  tree, lines, comments = ast.parse(source), source.split('\n'), _comments(source)
  node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
  docs = {}
  for stmt in node.body:
    if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
      continue
    above, line = [], stmt.lineno - 1
    while line >= 1 and lines[line - 1].strip().startswith('#'):
      above.insert(0, comments[line])
      line -= 1
    trailing = comments.get(stmt.lineno, '') if stmt.end_lineno == stmt.lineno else ''
    docs[stmt.target.id] = ' '.join(part for part in above + [trailing] if part)
  return docs


def _reference() -> tuple[list[Field], dict[str, str]]:
  """Every leaf field of Config, depth first in definition order, with its documentation; and
  each group's path ('' for the top level) -> its class docstring's first paragraph."""
  fields_out, groups_out = [], {}

  def walk(cls, prefix):
    groups_out[prefix[:-1]] = _first_paragraph(cls)
    docs, hints = _field_docs(cls), typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
      hint = hints[f.name]
      if dataclasses.is_dataclass(hint):
        walk(hint, f'{prefix}{f.name}.')
      else:
        fields_out.append(Field(f'{prefix}{f.name}', getattr(hint, '__name__', str(hint)),
                                f.default, docs.get(f.name, '')))
  walk(config_lib.Config, '')
  return fields_out, groups_out


def fields() -> list[Field]:
  """Every leaf field of Config, depth first in definition order, with its documentation."""
  return _reference()[0]


def groups() -> dict[str, str]:
  """Group path ('' for the top level) -> its class docstring's first paragraph."""
  return _reference()[1]


def _first_paragraph(cls) -> str:
  return ' '.join(inspect.getdoc(cls).split('\n\n')[0].split())


def _cell(text: str) -> str:
  return text.replace('|', '\\|')


def markdown() -> str:
  """The reference: one table per group, a row per field (path, type, default, meaning)."""
  all_fields, all_groups = _reference()
  by_group: dict[str, list[Field]] = {}
  for field in all_fields:
    by_group.setdefault(field.path.rpartition('.')[0], []).append(field)
  out = []
  for group, doc in all_groups.items():
    if group not in by_group:
      continue
    out += [f'## `{group}`' if group else '## Top level', '', _cell(doc), '',
            '| field | type | default | meaning |', '| --- | --- | --- | --- |']
    out += [f'| `{f.path}` | {f.type} | `{f.default!r}` | {_cell(f.doc)} |'
            for f in by_group[group]]
    out.append('')
  return '\n'.join(out)


if __name__ == '__main__':
  print(markdown())
