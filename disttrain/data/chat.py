"""Chat templates: a tokenizer directory's own jinja template, rendered as `transformers` does.

Instruct models ship the format they were tuned on: `chat_template.jinja`, or `chat_template` in
tokenizer_config.json (a string, or a list of named templates: 'default' is used). `load(path)`
finds it beside the tokenizer file and renders with transformers' environment (jinja2's
immutable sandbox, trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `strftime_now`,
a `tojson` that keeps non-ASCII, the tokenizer's special tokens as variables), so the text, and
the tokens of it encoded whole without added specials, equal `apply_chat_template`'s.

What is trained: the assistant turns, each with its end-of-turn token. A template that marks them
with `{% generation %}` blocks (transformers' assistant-mask extension) is read as marked; otherwise
each assistant turn is what rendering the conversation through it adds to rendering the turns before
it with the generation prompt, less trailing whitespace (ChatML's and Gemma's newline after the end
token) and less what the template closes a whole conversation with (Phi-3's EOS after the last turn:
what it renders for no turns, less an opening BOS). A template that renders an earlier turn
differently once later turns follow (some drop earlier reasoning) cannot be split this way and is
refused, naming the example: mark its assistant turns with generation blocks.
"""

import datetime
import json
import os
import re
from typing import Any

from disttrain.errors import DataError

_MARKS = '_disttrain_generation_marks'  # the render variable: (open, close) around generation


class Rendered(list):
  """(text, trained) pieces a chat template rendered: they hold the template's own special and
  end-of-turn tokens, so they are encoded with none added and no EOS after
  (Tokenizer.encode_pieces)."""


def find(tokenizer_file: str) -> tuple[str, str] | None:
  """(template, where it came from) beside a tokenizer file, or None."""
  folder = os.path.dirname(tokenizer_file)
  jinja_file = os.path.join(folder, 'chat_template.jinja')
  if os.path.isfile(jinja_file):
    with open(jinja_file, encoding='utf-8') as f:
      return f.read(), jinja_file
  config = os.path.join(folder, 'tokenizer_config.json')
  if not os.path.isfile(config):
    return None
  with open(config, encoding='utf-8') as f:
    template = json.load(f).get('chat_template')
  if isinstance(template, list):  # named templates
    template = next((t.get('template') for t in template if t.get('name') == 'default'), None)
  return (template, config) if isinstance(template, str) else None


def special_tokens(tokenizer_file: str) -> dict:
  """The special tokens' text by name (bos_token, eos_token, ...), as transformers reads them:
  tokenizer_config.json's, and where it has no added_tokens_decoder (an older save) those of
  special_tokens_map.json over them."""
  def read(name: str) -> tuple[dict, dict]:
    path = os.path.join(os.path.dirname(tokenizer_file), name)
    if not os.path.isfile(path):
      return {}, {}
    with open(path, encoding='utf-8') as f:
      values = json.load(f)
    found = {}
    for key in ('bos_token', 'eos_token', 'unk_token', 'sep_token', 'pad_token', 'cls_token',
                'mask_token'):
      value = values.get(key)
      value = value.get('content') if isinstance(value, dict) else value
      if isinstance(value, str):
        found[key] = value
    return values, found
  config, out = read('tokenizer_config.json')
  if 'added_tokens_decoder' not in config:
    out.update(read('special_tokens_map.json')[1])
  return out


def _environment():
  import jinja2  # pylint: disable=g-import-not-at-top
  from jinja2 import ext, nodes  # pylint: disable=g-import-not-at-top
  from jinja2.sandbox import ImmutableSandboxedEnvironment  # pylint: disable=g-import-not-at-top

  class Generation(ext.Extension):
    """{% generation %}...{% endgeneration %}: output between marks, found after rendering."""
    tags = {'generation'}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(('name:endgeneration',), drop_needle=True)
      return nodes.CallBlock(self.call_method('_mark', [nodes.Name(_MARKS, 'load')]), [], [],
                             body).set_lineno(lineno)

    def _mark(self, marks, caller):
      return marks[0] + caller() + marks[1]

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[Generation, ext.loopcontrols])
  env.filters['tojson'] = tojson
  env.globals['raise_exception'] = raise_exception
  env.globals['strftime_now'] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env


_REASONING = ('reasoning_content', 'thinking', 'reasoning')  # transformers' aliases, in order


def _normalized(message: Any) -> Any:
  """A message as transformers' apply_chat_template passes it: fields set to null dropped (an
  OpenAI export's "tool_calls": null crashed Llama 3.1's template) and a reasoning trace under
  any of its names given under reasoning_content and thinking (Qwen3's and gpt-oss's names)."""
  if not isinstance(message, dict):
    return message
  message = {k: v for k, v in message.items() if v is not None}
  trace = next((message[k] for k in _REASONING if k in message), None)
  return message if trace is None else {**message, 'reasoning_content': trace, 'thinking': trace}


class ChatTemplate:
  """One tokenizer's template: render(messages) -> text; pieces(messages) -> [(text, trained)]."""

  def __init__(self, source: str, where: str, special: dict):
    import jinja2  # pylint: disable=g-import-not-at-top
    self.source, self.where, self.special = source, where, special
    try:
      self._template = _environment().from_string(source)
    except jinja2.TemplateError as e:
      raise DataError(f'the chat template in {where} does not parse ({e}, line '
                      f'{getattr(e, "lineno", "?")}); fix it or set data.sft.chat_template=plain'
                      ) from e
    self._closing = None  # rendered for no turns, on first need
    self.marked = re.search(r'\{%-?\s*generation\s*-?%\}', source) is not None

  def __getstate__(self) -> dict:
    return {'source': self.source, 'where': self.where, 'special': self.special}

  def __setstate__(self, state: dict) -> None:
    self.__init__(state['source'], state['where'], state['special'])

  def render(self, messages: list, add_generation_prompt: bool = False, *,
             marks: tuple[str, str] = ('', ''), example: str = '') -> str:
    """The template's text for `messages`, `marks` around its generation blocks' output."""
    import jinja2  # pylint: disable=g-import-not-at-top
    try:
      return self._template.render(messages=[_normalized(m) for m in messages],
                                   add_generation_prompt=add_generation_prompt, tools=None,
                                   documents=None, **self.special, **{_MARKS: marks})
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
      raise DataError(f'{example or "the conversation"}: the chat template in {self.where} fails '
                      f'to render it: {type(e).__name__}: {e}') from e

  def _free_marks(self, messages: list) -> tuple[str, str]:
    """Two private-use characters that neither the conversation nor the template holds, so
    the marks found after rendering are the generation blocks' and no text of the data."""
    seen = set(json.dumps(messages, ensure_ascii=False, default=str) + self.source +
               ''.join(self.special.values()))
    free = (c for c in map(chr, range(0xE000, 0xF900)) if c not in seen)
    return next(free), next(free)

  def _turn_end(self, text: str, through: str) -> int | None:
    """Where the conversation rendered through a turn ends that turn in the whole text: less the
    template's closing (what it renders for no turns, Phi-3's EOS) where it ends the text there,
    less the longest end of it where the text goes on past the turn; None where it does not."""
    if self._closing is None:
      try:  # less the BOS a template opens with (Phi-3-small's is its EOS too)
        self._closing = self.render([]).removeprefix(self.special.get('bos_token') or '')
      except DataError:  # a template that needs a turn: no closing we can tell
        self._closing = ''
    closing = self._closing
    if text.startswith(through):
      return len(through) - len(closing) if closing and through.endswith(closing) else len(through)
    for k in range(len(closing), 0, -1):  # longest first: '<|endoftext|>', not 'xt|>'
      tail = closing[-k:]
      if through.endswith(tail) and text.endswith(tail) and text.startswith(through[:-k]):
        return len(through) - k
    return None

  def pieces(self, messages: list, example: str) -> list[tuple[str, bool]]:
    """The conversation's text in order, as (text, trained) pieces: assistant turns trained."""
    if self.marked:
      marks = self._free_marks(messages)
      raw, spans, at = self.render(messages, marks=marks, example=example), [], 0
      for part in re.split(f'([{marks[0]}{marks[1]}])', raw):
        if part == marks[0]:
          start = at
        elif part == marks[1]:
          spans.append((start, at))
        else:
          at += len(part)
      text = raw.replace(marks[0], '').replace(marks[1], '')
    else:
      text, spans = self.render(messages, example=example), []
      for i, turn in enumerate(messages):
        if turn.get('role') != 'assistant':
          continue
        before = self.render(messages[:i], True, example=example)
        through = self.render(messages[:i + 1], example=example)
        end = self._turn_end(text, through)
        if end is None or not through.startswith(before) or end < len(before):
          raise DataError(f'{example}: the chat template in {self.where} renders turn {i + 1} '
                          'differently once later turns follow, so its assistant text cannot be '
                          'told apart; mark assistant turns with {% generation %} blocks or set '
                          'data.sft.chat_template=plain')
        spans.append((len(before), len(through[:end].rstrip())))
    out, at = [], 0
    for start, end in spans:
      out += [(text[at:start], False), (text[start:end], True)]
      at = end
    out.append((text[at:], False))
    return Rendered((t, trained) for t, trained in out if t)


def load(tokenizer_file: str, setting: str = 'auto') -> ChatTemplate | None:
  """The template data.sft.chat_template names: auto (the tokenizer's own, None without one),
  plain (None: disttrain's '<|role|>' format) or a .jinja file."""
  if setting == 'plain' or not tokenizer_file and setting == 'auto':
    return None
  if setting == 'auto':
    found = find(tokenizer_file)
    return ChatTemplate(*found, special_tokens(tokenizer_file)) if found else None
  if not os.path.isfile(setting):
    raise DataError(f'data.sft.chat_template={setting!r} is not a file; pass a .jinja file, auto '
                    'or plain')
  with open(setting, encoding='utf-8') as f:
    return ChatTemplate(f.read(), setting, special_tokens(tokenizer_file) if tokenizer_file
                        else {})
