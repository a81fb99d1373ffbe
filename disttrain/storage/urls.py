"""Where a run's files live: a local directory, gs://BUCKET/PATH or s3://BUCKET/PATH.

The one place that knows storage URLs. Arrays go through orbax and tensorstore (its `gcs` and
`s3` drivers), files through etils.epath on fsspec (gcsfs, s3fs: the `gcs` and `s3` extras).
Endpoints and credentials come from each cloud's standard settings: S3 reads AWS_ENDPOINT_URL_S3
or AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or a profile) and AWS_REGION or
AWS_DEFAULT_REGION; GCS reads application-default credentials, or STORAGE_EMULATOR_HOST, with
which (as google-cloud-storage does) every client talks anonymously to the emulator.

Object stores have no rename and no append. Checkpoints therefore commit with a marker file
(orbax's commit_success.txt, which gs:// gets from orbax and s3:// from here), small files are
written whole (one PUT is atomic), and the files process 0 appends to (metrics.jsonl,
TensorBoard events, profiles) are written to a local mirror that `Mirror.push` uploads.

orbax maps only gs:// to a tensorstore driver (orbax#2739); `_serve_s3` wraps orbax's kvstore
spec builder so that s3:// URLs get tensorstore's `s3` driver with the endpoint and region above.
"""

import functools
import os
import re
import shutil
import tempfile
import threading
import time
from urllib import parse

from etils import epath

from disttrain.errors import ConfigError

SCHEMES = {'gs': ('gcsfs', 'gcs'), 's3': ('s3fs', 's3')}  # scheme -> (module, extra)


def scheme(path: str) -> str:
  """'gs', 's3' or '' (a local path); another URL scheme is refused in one line."""
  typo = re.match(r'\s*([A-Za-z][A-Za-z0-9+.-]*):/(?!/)', str(path))
  if typo and typo.group(1).lower() in SCHEMES:  # else a local dir 's3:', lost with the disk
    raise ConfigError(f'{path!r} looks like a storage URL with one slash; pass '
                      f'{typo.group(1).lower()}://BUCKET/PATH, or ./{path} for a local directory')
  if '://' in str(path) and str(path) != str(path).strip():
    raise ConfigError(f'{path!r} has a leading or trailing space; remove it')
  found = parse.urlparse(str(path)).scheme if '://' in str(path) else ''
  written = str(path).split('://', 1)[0]
  if found in SCHEMES and written != found:  # gcsfs and s3fs know the lowercase scheme only
    raise ConfigError(f'{path!r}: write the scheme in lowercase, {found}://')
  if found and found not in SCHEMES:
    raise ConfigError(f'{path!r}: storage URLs must be gs://BUCKET/PATH or s3://BUCKET/PATH '
                      f'(not {found}://); or pass a local directory')
  return found


def is_bucket(path: str) -> bool:
  return bool(scheme(path))


def resolve(path: str) -> str:
  """A local path made absolute, or a bucket URL (its extra checked, its clients configured)."""
  kind = scheme(path)
  if not kind:
    return os.path.abspath(os.path.expanduser(str(path)))
  module, extra = SCHEMES[kind]
  try:
    __import__(module)
  except ImportError:
    raise ConfigError(f'{path!r} needs {module}, which is not installed; pip install '
                      f"'disttrain[{extra}]'") from None
  _configure(kind)
  url = str(path).rstrip('/')
  if not parse.urlparse(url).netloc:
    raise ConfigError(f'{path!r} names no bucket; pass {kind}://BUCKET/PATH')
  # tensorstore reads '#' and '?' as a URL's fragment and query, and '..' as a step up, where
  # s3fs and gcsfs take them literally: the arrays would land apart from their checkpoint.
  odd = next((why for bad, why in (
      ('#' in url or '?' in url, "a '#' or '?'"),
      ('..' in url.split('://', 1)[1].split('/'), "a '..' segment"),
      (any(p != p.strip() for p in url.split('/')), 'a leading or '
       'trailing space')) if bad), None)
  if odd:
    raise ConfigError(f'{path!r}: a bucket path with {odd} is not stored where it reads '
                      '(the checkpoint arrays would land elsewhere); rename the path')
  return url


def join(base: str, *parts: str) -> str:
  return '/'.join([base.rstrip('/'), *parts]) if is_bucket(base) else os.path.join(base, *parts)


def path(url: str) -> epath.Path:
  kind = scheme(url)
  if kind:
    _configure(kind)
  return epath.Path(url)


def _configure(kind: str) -> None:
  """Client settings from the environment as it is now (each file system instance fsspec caches
  is keyed by them, so a changed endpoint gets a new client)."""
  import fsspec  # pylint: disable=g-import-not-at-top
  conf = fsspec.config.conf.setdefault(kind, {})
  conf['use_listings_cache'] = False  # other processes and attempts write the same prefixes
  if kind == 'gs':
    emulator = os.environ.get('STORAGE_EMULATOR_HOST')
    if emulator:
      conf.update(token='anon', endpoint_url=emulator)
      os.environ.setdefault('TENSORSTORE_GCS_HTTP_URL', emulator)
      os.environ.setdefault('GOOGLE_AUTH_TOKEN_FOR_TESTING', 'anonymous')  # no metadata lookup
      _plain_gcsfs()
    else:
      for key in ('token', 'endpoint_url'):
        conf.pop(key, None)
  if kind == 's3':
    conf['endpoint_url'] = s3_endpoint()[0]
    _serve_s3()


@functools.cache
def _plain_gcsfs() -> None:
  """gcsfs's default class asks the (gRPC) control API for a bucket's layout, which emulators do
  not serve (a 60 s timeout per bucket): the emulator gets the plain JSON-API class."""
  import fsspec  # pylint: disable=g-import-not-at-top
  from gcsfs import core  # pylint: disable=g-import-not-at-top
  fsspec.register_implementation('gs', core.GCSFileSystem, clobber=True)
  fsspec.register_implementation('gcs', core.GCSFileSystem, clobber=True)


def s3_endpoint() -> tuple[str | None, str | None]:
  """(endpoint URL, region) from the standard AWS settings; None where unset."""
  return (os.environ.get('AWS_ENDPOINT_URL_S3') or os.environ.get('AWS_ENDPOINT_URL'),
          os.environ.get('AWS_REGION') or os.environ.get('AWS_DEFAULT_REGION'))


def _serve_s3() -> None:
  """Gives orbax's kvstore specs for s3:// URLs tensorstore's s3 driver (see the module doc)."""
  # pylint: disable-next=g-import-not-at-top
  from orbax.checkpoint._src.serialization import tensorstore_utils
  build = tensorstore_utils.build_kvstore_tspec
  if getattr(build, 'disttrain_s3', False):
    return

  def to_s3(spec):
    if isinstance(spec, list):
      return [to_s3(v) for v in spec]
    if not isinstance(spec, dict):
      return spec
    spec = {k: to_s3(v) for k, v in spec.items()}
    if spec.get('driver') == 'gcs':  # the s3:// URL orbax was shown as gs://
      spec['driver'] = 's3'
      endpoint, region = s3_endpoint()
      spec.update({k: v for k, v in (('endpoint', endpoint), ('aws_region', region)) if v})
      if os.environ.get('AWS_ACCESS_KEY_ID'):  # the default chain logs 10 lines per save
        spec['aws_credentials'] = {'type': 'environment'}  # probing ~/.aws/ first
    return spec

  def build_s3(directory, *args, **kwargs):
    if str(directory).startswith('s3://'):
      return to_s3(build('gs://' + str(directory)[len('s3://'):], *args, **kwargs))
    return build(directory, *args, **kwargs)

  build_s3.disttrain_s3 = True
  tensorstore_utils.build_kvstore_tspec = build_s3


def check_writable(url: str) -> None:
  """Writes and deletes a probe object: a missing bucket, denied access or missing credentials
  is one line naming the bucket and the operation, before any work starts."""
  probe = path(join(url, f'.disttrain-probe-{os.getpid()}'))
  bucket = parse.urlparse(url).netloc
  try:
    probe.write_text('ok')
    probe.unlink()
  except Exception as e:  # pylint: disable=broad-except
    raise ConfigError(f'cannot write to {url} (bucket {bucket!r}): {_why(e)}; check that the '
                      f'bucket exists and that {_credentials(url)} allow writing') from None


def _why(e: Exception) -> str:
  text = ' '.join(str(e).split())[:200]
  return f'{type(e).__name__}: {text}' if text else type(e).__name__


def _credentials(url: str) -> str:
  if scheme(url) == 's3':
    return ('the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE or '
            '~/.aws/credentials; endpoint AWS_ENDPOINT_URL)')
  return ('the credentials (GOOGLE_APPLICATION_CREDENTIALS or gcloud auth '
          'application-default login; emulator STORAGE_EMULATOR_HOST)')


def unreadable(url: str, error: Exception) -> ConfigError:
  """One line for a report tool (plot, goodput) that cannot read `url`: a directory, bytes that
  are not text, or a bucket client's own error (credentials, a malformed name)."""
  check = (f'check that the bucket exists and that {_credentials(url)} allow reading'
           if is_bucket(url) else 'pass a run directory (--workdir of a run)')
  return ConfigError(f'cannot read {url}: {_why(error)}; {check}')


def read_text(url: str) -> str | None:
  """The file's text, or None if there is none."""
  try:
    return path(url).read_text()
  except FileNotFoundError:
    return None


def write_text(url: str, text: str) -> None:
  """Readers see the old text or the new one, never part of one (local: a rename; buckets: one
  PUT)."""
  if is_bucket(url):
    path(url).write_text(text)
    return
  os.makedirs(os.path.dirname(url) or '.', exist_ok=True)
  tmp = f'{url}.{os.getpid()}.tmp'
  with open(tmp, 'w', encoding='utf-8') as f:
    f.write(text)
  os.replace(tmp, url)


def append_line(url: str, line: str) -> None:
  """Appends one line (buckets: the object is rewritten, so keep this to rare events)."""
  if not is_bucket(url):
    os.makedirs(os.path.dirname(url) or '.', exist_ok=True)
    with open(url, 'a', encoding='utf-8') as f:
      f.write(line + '\n')
    return
  path(url).write_text((read_text(url) or '') + line + '\n')


def move_tree(source: str, target: str) -> None:
  """Moves a directory: a rename locally; in a bucket, which has no directory rename, each
  object copied (server side) before the source is removed."""
  src, dst = path(source), path(target)
  if not is_bucket(source):
    dst.parent.mkdir(parents=True, exist_ok=True)
    src.rename(dst)
    return

  def files(folder):
    for child in folder.iterdir():
      yield from files(child) if child.is_dir() else [child]
  for file in list(files(src)):
    file.copy(dst / file.relative_to(src))
  src.rmtree()


def committed_steps(directory: str) -> list[int]:
  """Steps of the complete checkpoints in a checkpoints directory: locally a step's directory
  appears by rename when it commits; in a bucket it commits when its marker is written."""
  root = path(directory)
  try:
    names = [p.name for p in root.iterdir()]
  except (FileNotFoundError, NotADirectoryError):
    return []
  steps = sorted(int(n) for n in names if n.isdigit())
  if is_bucket(directory):
    steps = [s for s in steps if (root / str(s) / 'commit_success.txt').exists()]
  return steps


class Mirror:
  """Process 0's appended files of a bucket workdir, kept in a local directory and uploaded by a
  background thread when `push` asks (at most every `every` seconds unless forced), so the loop
  never waits for an upload; `close` uploads the rest. For a local workdir it is the workdir."""

  def __init__(self, url: str, pull: tuple[str, ...] = (), every: float = 30.0,
               every_small: float = 2.0):
    self.url, self.every, self.every_small = url, every, every_small
    self.bucket = is_bucket(url)
    self.local = tempfile.mkdtemp(prefix='disttrain-mirror-') if self.bucket else url
    self._sent: dict[str, tuple[int, float]] = {}
    self._last = 0.0
    self._wanted: set[str] | None = set()  # what the next upload sends; None = every change
    self._lock = threading.Lock()
    self._due, self._stop = threading.Event(), threading.Event()
    self._error: Exception | None = None
    for name in pull if self.bucket else ():
      text = read_text(join(url, name))
      if text is not None:
        with open(os.path.join(self.local, name), 'w', encoding='utf-8') as f:
          f.write(text)
        self._sent[name] = self._stamp(name)
    self._thread = None
    if self.bucket:
      self._thread = threading.Thread(target=self._upload_when_due, name='disttrain-mirror',
                                      daemon=True)
      self._thread.start()

  def _stamp(self, name: str) -> tuple[int, float]:
    st = os.stat(os.path.join(self.local, name))
    return st.st_size, st.st_mtime

  def push(self, force: bool = False, names: tuple[str, ...] = ()) -> None:
    """Asks for an upload of the files that changed since the last one; `names` alone (small
    files, e.g. the progress marker) go within `every_small` seconds in between."""
    if not self.bucket:
      return
    with self._lock:
      if force or time.monotonic() - self._last >= self.every:
        self._last = time.monotonic()
        self._wanted = None
        self._due.set()
      elif names and self._wanted is not None:
        self._wanted |= set(names)  # the thread sends them at its next tick

  def _upload_when_due(self) -> None:
    while not self._stop.is_set():
      self._due.wait(timeout=self.every_small)  # a tick: the small files asked for since
      self._due.clear()
      with self._lock:
        wanted, self._wanted = self._wanted, set()
      if wanted is not None and not wanted:
        continue
      try:
        self._upload(wanted)
      except Exception as e:  # pylint: disable=broad-except  # raised by close(), at the end
        self._error = e

  def _upload(self, wanted: set[str] | None = None) -> None:
    for root, _, names in os.walk(self.local):
      for n in names:
        name = os.path.relpath(os.path.join(root, n), self.local)
        if wanted is not None and name not in wanted:
          continue
        stamp = self._stamp(name)
        if self._sent.get(name) != stamp:
          with open(os.path.join(self.local, name), 'rb') as f:
            path(join(self.url, *name.split(os.sep))).write_bytes(f.read())
          self._sent[name] = stamp

  def close(self) -> None:
    """Uploads what is left and removes the local copy (a bucket workdir's)."""
    if self._thread is None:
      return
    self._stop.set()
    self._due.set()
    self._thread.join()
    self._thread = None
    try:
      self._upload()
    except Exception as e:  # pylint: disable=broad-except
      self._error = self._error or e
    if self._error is not None:
      raise ConfigError(f'uploading the run\'s records to {self.url} failed ({_why(self._error)}); '
                        f'they are kept in {self.local}; the checkpoints are not affected')
    shutil.rmtree(self.local, ignore_errors=True)
