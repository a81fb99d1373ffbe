"""MkDocs hooks: the landing page is README.md, the config reference is generated from config/."""

import pathlib
import re

from disttrain import config_reference

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_CONFIG_MARKER = '<!-- config fields: generated from disttrain/config/ -->'


def on_page_read_source(page, config):
  """index.md is the README, with its links into docs/ made relative to the site."""
  if page.file.src_uri == 'index.md':
    return re.sub(r'\]\(docs/', '](', (_ROOT / 'README.md').read_text())
  return None


def on_page_markdown(markdown, page, config, files):
  if _CONFIG_MARKER in markdown:
    return markdown.replace(_CONFIG_MARKER, config_reference.markdown())
  return markdown
