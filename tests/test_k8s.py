"""launch/k8s/: the JobSet manifests are valid, and the environment they give pods forms one job.

Schemas: JobSet v0.9.1's published CRD schema (v1alpha2, bundled in tests/data: it embeds the
Kubernetes Job and Pod schemas) with unknown fields rejected, as `kubectl apply` does with strict
field validation; and each replicated Job checked again by kubernetes-validate against the
Kubernetes release it bundles. The emulated pods: what the kubelet would resolve (field refs to
the JobSet name label and the completion index, `$(VAR)` references) run as local processes,
the coordinator's DNS name answered by 127.0.0.1, each process with 4 fake CPU devices.
"""

import copy
import gzip
import json
import re
import subprocess
import sys

import jsonschema
import numpy as np
import pytest
import yaml

import disttrain
from disttrain import config as config_lib
from disttrain.exitcodes import Exit
from disttrain.parallel import distributed
from tests import helpers
from tests.conftest import ROOT, subprocess_env

MANIFESTS = sorted((ROOT / 'launch' / 'k8s').glob('*.yaml'))
SCHEMA = ROOT / 'tests' / 'data' / 'jobset-v0.9.1-v1alpha2.schema.json.gz'


def _strict(schema):
  """The schema with unknown fields rejected wherever it lists an object's fields."""
  if isinstance(schema, list):
    return [_strict(s) for s in schema]
  if not isinstance(schema, dict):
    return schema
  out = {}
  for key, value in schema.items():
    if key in ('properties', 'patternProperties'):
      out[key] = {name: _strict(s) for name, s in value.items()}
    elif key in ('items', 'additionalProperties', 'not', 'allOf', 'anyOf', 'oneOf'):
      out[key] = _strict(value)
    else:
      out[key] = value
  if 'properties' in out and 'additionalProperties' not in out and \
      not out.get('x-kubernetes-preserve-unknown-fields'):
    out['additionalProperties'] = False
  return out


@pytest.fixture(scope='module')
def validator():
  with gzip.open(SCHEMA) as f:
    schema = json.load(f)['openAPIV3Schema']
  return jsonschema.Draft7Validator(_strict(schema))


def _errors(validator, manifest) -> list[str]:
  return [f'{"/".join(map(str, e.absolute_path))}: {e.message[:200]}'
          for e in validator.iter_errors(manifest)]


@pytest.mark.parametrize('path', MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_manifests_pass_the_jobset_and_kubernetes_schemas(path, validator):
  import kubernetes_validate  # pylint: disable=g-import-not-at-top
  (manifest,) = list(yaml.safe_load_all(path.read_text()))
  assert manifest['kind'] == 'JobSet' and manifest['apiVersion'] == 'jobset.x-k8s.io/v1alpha2'
  assert _errors(validator, manifest) == []
  for job in manifest['spec']['replicatedJobs']:
    kubernetes_validate.validate(
        {'apiVersion': 'batch/v1', 'kind': 'Job', 'metadata': {'name': job['name']},
         'spec': job['template']['spec']}, kubernetes_validate.latest_version(), strict=True)
    # The exit-code contract, as the pod failure policy and the JobSet failure policy read it.
    rules = job['template']['spec']['podFailurePolicy']['rules']
    final = [r for r in rules if r['action'] == 'FailJob'][0]['onExitCodes']['values']
    ignored = [r for r in rules if r['action'] == 'Ignore' and 'onExitCodes' in r][0]
    assert sorted(final) == [Exit.BAD_INPUT, Exit.INTERRUPTED]
    assert ignored['onExitCodes']['values'] == [Exit.PREEMPTED]
    assert job['template']['spec']['backoffLimit'] == 0  # any other failure restarts the gang
  assert {'name': 'bad-input-or-ctrl-c', 'action': 'FailJobSet',
          'onJobFailureReasons': ['PodFailurePolicy']} in \
      manifest['spec']['failurePolicy']['rules']


def test_tpu_slices_agree_on_the_dcn_mesh():
  """The multi-slice recipe: as many slices as MEGASCALE_NUM_SLICES and dcn_mesh.data, the
  coordinator at slice 0's host 0 by the JobSet's host names, and a mesh that fills the slices."""
  (manifest,) = list(yaml.safe_load_all((ROOT / 'launch' / 'k8s' / 'tpu-jobset.yaml').read_text()))
  (job,) = manifest['spec']['replicatedJobs']
  (container,) = job['template']['spec']['template']['spec']['containers']
  env = {e['name']: e.get('value', e.get('valueFrom')) for e in container['env']}
  flags = dict(a.removeprefix('--').split('=', 1) for a in container['args'] if '=' in a)
  slices = job['replicas']
  assert int(env['MEGASCALE_NUM_SLICES']) == int(flags['config.dcn_mesh.data']) == slices > 1
  assert env['MEGASCALE_SLICE_ID'] == {
      'fieldRef': {'fieldPath': "metadata.labels['jobset.sigs.k8s.io/job-index']"}}
  name = manifest['metadata']['name']
  assert manifest['spec']['network']['enableDNSHostnames']
  assert env['MEGASCALE_COORDINATOR_ADDRESS'] == f'{name}-{job["name"]}-0-0.{name}'
  chips = job['template']['spec']['completions'] * container['resources']['limits']['google.com/tpu']
  overrides = {k.removeprefix('config.'): int(v) if v.isdigit() else v
               for k, v in flags.items() if k.startswith('config.')}
  cfg = config_lib.from_config_dict(helpers.override(
      helpers.config_file(ROOT / flags['config']), overrides))
  inside = cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.tensor * cfg.mesh.stage * cfg.mesh.context
  assert inside * cfg.mesh.expert == chips  # mesh.* fills one slice, dcn_mesh.* spans them


def test_the_schema_check_catches_mistakes(validator):
  (manifest,) = list(yaml.safe_load_all((ROOT / 'launch' / 'k8s' / 'gpu-jobset.yaml').read_text()))
  typo = copy.deepcopy(manifest)
  spec = typo['spec']['replicatedJobs'][0]['template']['spec']
  spec['backofLimit'] = spec.pop('backoffLimit')
  assert any('backofLimit' in e for e in _errors(validator, typo))
  wrong = copy.deepcopy(manifest)
  wrong['spec']['failurePolicy']['rules'][0]['action'] = 'Restart'
  assert _errors(validator, wrong)


def _pod_environment(container: dict, labels: dict, annotations: dict) -> dict:
  """The container's environment as the kubelet resolves it: field refs, then $(VAR)."""
  env = {}
  for item in container['env']:
    if 'value' in item:
      env[item['name']] = re.sub(r'\$\((\w+)\)', lambda m: env.get(m.group(1), m.group(0)),
                                 item['value'])
    else:
      path = item['valueFrom']['fieldRef']['fieldPath']
      kind, key = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path).groups()
      env[item['name']] = (labels if kind == 'labels' else annotations)[key]
  return env


@pytest.mark.slow
def test_emulated_gpu_pods_form_one_2x4_job_equal_to_1x8(tmp_path):
  (manifest,) = list(yaml.safe_load_all((ROOT / 'launch' / 'k8s' / 'gpu-jobset.yaml').read_text()))
  name = manifest['metadata']['name']
  (job,) = manifest['spec']['replicatedJobs']
  pods = job['template']['spec']['completions']
  container = job['template']['spec']['template']['spec']['containers'][0]
  port = distributed.free_port_pair()  # and port + 1, for the roll call
  overrides = {'model.hidden': 64, 'global_batch_size': 64, 'num_train_steps': 10,
               'log_every_steps': 1, 'eval_every_steps': 0, 'model.dropout': 0.0}
  procs = []
  for index in range(pods):
    env = _pod_environment(container, {'jobset.sigs.k8s.io/jobset-name': name},
                           {'batch.kubernetes.io/job-completion-index': str(index)})
    host = f'{name}-{job["name"]}-0-0.{name}'  # what JobSet's headless service resolves
    assert env['JAX_COORDINATOR_ADDRESS'].startswith(f'{host}:')
    env['JAX_COORDINATOR_ADDRESS'] = f'127.0.0.1:{port}'  # the emulated service's answer
    args = [a for a in container['args'] if not a.startswith(('--config', '--workdir='))]
    fields = [a for a in container['args'] if a.startswith('--config.')]  # the manifest's own
    command = [sys.executable if c == 'python' else c for c in container['command']]
    procs.append(subprocess.Popen(
        [*command, *args, '--config=launch/configs/mnist_mlp.py', *fields,
         f'--workdir={tmp_path}', '--fake_devices=4',
         *(f'--config.{k}={v}' for k, v in overrides.items())],
        cwd=ROOT, env={**_clean_env(), **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True))
  outs = [p.communicate(timeout=300)[0] for p in procs]
  assert [p.returncode for p in procs] == [0] * pods, outs[0][-3000:] + outs[1][-3000:]
  assert 'disttrain: 8 devices' in outs[0]
  # The manifest's dcn_mesh.data (= its pod count) puts data, and only data, across the pods.
  info = json.loads((tmp_path / 'run.json').read_text())
  assert info['config']['dcn_mesh']['data'] == pods and info['dcn_axes'] == ['data']
  cfg = config_lib.from_config_dict(helpers.override(
      helpers.config_file(ROOT / 'launch' / 'configs' / 'mnist_mlp.py'), overrides))
  one = disttrain.train(cfg, str(tmp_path / 'one'))
  want = [r['loss'] for r in one.records if r['split'] == 'train']
  got = [r['loss'] for r in helpers.metrics_records(tmp_path)]
  np.testing.assert_allclose(got, want, rtol=1e-4)  # as tests/test_multiprocess.py: 10 steps


def _clean_env() -> dict:
  return subprocess_env()
