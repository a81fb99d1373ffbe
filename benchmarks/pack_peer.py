"""Pack what MaxText imports, minus what a GPU image already has, for a host with no registry.

  python benchmarks/pack_peer.py   # writes .peer/maxtext.cp312-x86_64.tar.xz; carry .peer to the host
  # on the host, benchmarks/accelerator.sh unpacks it into a venv-shaped folder for peers.py

The lent GPU machines reach no package registry and carry at most 64 MiB, so MaxText's own venv
(about 3 GB, with its CUDA wheels) cannot travel. The host's image has jax with CUDA, flax, optax,
orbax, transformers and more; MaxText needs about 30 packages beside them. This runs two steps
of MaxText on CPU in its venv (benchmarks/peers.py makes it) with DECOUPLE_GCLOUD=TRUE (MaxText's
switch that stubs Google Cloud logging and diagnostics off Google Cloud), records every module it
imported, and packs the packages the image lacks: whole, unless a package is larger than
--whole_mb, then only its imported files (google.cloud's generated clients, xprof's profiler).
One module is replaced by an empty one: xprof's kernel-statistics tool, which tokamax imports for
its kernel benchmarks and which needs xprof's 80 MB plugin; MaxText's training never calls it.
"""

import io
import os
import subprocess
import sys
import tarfile
import tempfile

from absl import app, flags

_VENV = flags.DEFINE_string('peer_venv', os.path.expanduser('~/.cache/disttrain/peers/maxtext'),
                            "MaxText's venv (benchmarks/peers.py makes it).")
_OUT = flags.DEFINE_string('out', '.peer/maxtext.tar.xz', 'The archive to write; the name gains '
                           'the Python and machine it runs on, e.g. maxtext.cp312-x86_64.tar.xz.')
_WHOLE_MB = flags.DEFINE_float('whole_mb', 12, 'Larger packages travel as their imported files.')
# Import names the GPU image holds (device README, KINDS.md's package list of 2026-11-17), and
# what disttrain's own carried wheels (.whl) bring; libtpu is TPU-only.
_HAVE = flags.DEFINE_list('have', [
    'absl', 'aiohappyeyeballs', 'aiohttp', 'aiosignal', 'annotated_doc', 'anyio', 'attr', 'attrs',
    'certifi', 'charset_normalizer', 'chex', 'click', 'cloudpickle', 'colorama', 'etils',
    'filelock', 'flatbuffers', 'flax', 'frozenlist', 'fsspec', 'grpc', 'h11', 'httpcore', 'httpx',
    'huggingface_hub', 'humanize', 'idna', 'jax', 'jaxlib', 'jaxtyping', 'jinja2', 'markupsafe',
    'ml_dtypes', 'mpmath', 'msgpack', 'multidict', 'numpy', 'opt_einsum', 'optax', 'orbax',
    'packaging', 'PIL', 'prometheus_client', 'propcache', 'psutil', 'pygments', 'regex',
    'requests', 'rich', 'scipy', 'sentencepiece', 'simplejson', 'six', 'sympy', 'tensorstore',
    'tiktoken', 'tiktoken_ext', 'tokenizers', 'tqdm', 'transformers', 'treescope',
    'typing_extensions', 'urllib3', 'uvloop', 'wadler_lindig', 'yaml', 'yarl', 'google/protobuf',
    'google/_upb', '_distutils_hack', '_pynvml_redirector', 'libtpu', 'grain', 'array_record',
    'ml_collections', 'portpicker', 'tensorboardX'], 'Import names the target image has.')
_STUBS = {'xprof/cli/tools/get_kernel_stats_tool.py':
          '"""Empty: see benchmarks/pack_peer.py (needs xprof\'s 80 MB plugin)."""\n'}
_RECORD = '''import atexit, sys
def _dump():
  with open(%r, 'w') as f:
    f.writelines(f"{getattr(m, '__file__', None)}\\n" for m in list(sys.modules.values()))
atexit.register(_dump)
'''


def imported_files(python: str, site: str, scratch: str) -> list[str]:
  """Paths, relative to site, of the modules two CPU steps of MaxText import."""
  with open(os.path.join(scratch, 'sitecustomize.py'), 'w') as f:
    f.write(_RECORD % os.path.join(scratch, 'modules.txt'))
  args = dict(run_name='pack', base_output_directory=scratch, hardware='cpu', steps=2,
              skip_jax_distributed_system='true', dataset_type='synthetic',
              enable_checkpointing='false', decoder_block='llama2', base_emb_dim=64,
              base_num_query_heads=2, base_num_kv_heads=1, base_mlp_dim=128,
              base_num_decoder_layers=1, head_dim=32, vocab_size=256, max_target_length=64,
              per_device_batch_size=2, logits_via_embedding='true', attention='dot_product')
  env = dict(os.environ, PYTHONPATH=scratch, JAX_PLATFORMS='cpu', DECOUPLE_GCLOUD='TRUE')
  cmd = [python, '-m', 'maxtext.trainers.pre_train.train',
         os.path.join(site, 'maxtext', 'configs', 'base.yml')]
  done = subprocess.run(cmd + [f'{k}={v}' for k, v in args.items()], env=env,
                        capture_output=True, text=True)
  if done.returncode:
    sys.exit(f'error: MaxText did not run in {_VENV.value}: {done.stderr[-500:]}')
  with open(os.path.join(scratch, 'modules.txt')) as f:
    paths = [line.strip() for line in f]
  return sorted({os.path.relpath(p, site) for p in paths if p.startswith(site + os.sep)})


def top(rel: str) -> str:
  """The import root a file belongs to ('google/cloud' splits a namespace package)."""
  parts = rel.split(os.sep)
  name = os.sep.join(parts[:2]) if parts[0] == 'google' and len(parts) > 2 else parts[0]
  return name.split('.')[0] if len(parts) == 1 else name


def travels(path: str) -> bool:
  """Whether a package's file goes in the archive: not its assets (tokenizers) or caches."""
  return not {'__pycache__', 'assets'} & set(path.split(os.sep))


def size_mb(path: str) -> float:  # what travels of a package
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs
             if travels(os.path.join(d, f))) / 2**20


def main(argv):
  del argv
  python = os.path.join(_VENV.value, 'bin', 'python')
  site = subprocess.run([python, '-c', 'import maxtext, os; print(os.path.dirname('
                         'os.path.dirname(maxtext.__file__)))'], capture_output=True,
                        text=True).stdout.strip()
  if not site:
    sys.exit(f'error: no MaxText in {_VENV.value}; run benchmarks/peers.py once to make it')
  with tempfile.TemporaryDirectory() as scratch:
    files = imported_files(python, site, scratch)
  roots = sorted({top(rel) for rel in files} - set(_HAVE.value))
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  skip = lambda info: info if travels(info.name) else None
  packed = set()  # files that travel, relative to site
  # The archive's name says what it runs on: its compiled modules are this CPython's, this machine's.
  tag = f'cp{sys.version_info[0]}{sys.version_info[1]}-{os.uname().machine}'
  out = _OUT.value.replace('.tar.xz', f'.{tag}.tar.xz') if tag not in _OUT.value else _OUT.value
  with tempfile.NamedTemporaryFile(dir=os.path.dirname(os.path.abspath(out)), delete=False) as tmp:
    with tarfile.open(tmp.name, 'w:xz') as tar:
      for root in roots:
        path = os.path.join(site, root)
        # maxtext always whole: its configs (base.yml) are read, not imported; *.libs: wheels' .so
        whole = [p for p in (path, path + '.libs') if os.path.isdir(p)]
        if whole and (root == 'maxtext' or size_mb(path) <= _WHOLE_MB.value):
          for top_dir in whole:
            tar.add(top_dir, os.path.relpath(top_dir, site), filter=skip)
            packed.update(os.path.relpath(os.path.join(d, f), site) for d, _, fs in
                          os.walk(top_dir) for f in fs if travels(os.path.join(d, f)))
        else:
          for rel in files:
            if top(rel) == root and rel not in _STUBS:
              tar.add(os.path.join(site, rel), rel)
              packed.add(rel)
      for entry in os.listdir(site):  # the metadata of what travels (importlib.metadata.version)
        record = os.path.join(site, entry, 'RECORD')
        if entry.endswith('.dist-info') and os.path.exists(record):
          with open(record) as f:
            if any(os.path.normpath(line.split(',')[0]) in packed for line in f):
              tar.add(os.path.join(site, entry), entry, filter=skip)
      for rel, text in _STUBS.items():
        info = tarfile.TarInfo(rel)
        info.size = len(text.encode())
        tar.addfile(info, io.BytesIO(text.encode()))
  os.replace(tmp.name, out)  # a failed pack leaves no archive to unpack
  print(f'{out}: {len(roots)} packages ({", ".join(roots)}), '
        f'{os.path.getsize(out) / 2**20:.1f} MiB')


if __name__ == '__main__':
  app.run(main)
