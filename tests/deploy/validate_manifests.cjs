// Renders a kustomization (or reads a YAML file), validates every object against the Kubernetes
// and Prometheus Operator schemas (kubernetes-models; no network, no cluster), then checks the
// kvcd-specific policy the deployment promises: non-root, read-only, no capabilities, gRPC probes
// on the health port, a grace period above drain + shutdown, memory = store + overhead, GPU only
// where expected, Services and monitors that select the pods.
//
// Usage: node validate_manifests.cjs --modules=DIR (--kustomize=DIR [--kubectl=PATH] | --file=F)
//            [--expect=cpu|gpu]
// Exit 0 when every check passes; 1 with one "FAIL:" line per problem otherwise.
'use strict';
const fs = require('fs');
const { execFileSync } = require('child_process');
const lib = require('./lib.cjs');

const args = lib.parseArgs(process.argv.slice(2));
const req = lib.modulesRequire(args.modules);
const YAML = req('yaml');

// The least overhead above the store budget (deploy/OPERATIONS.md, "Sizing"): binary, threads,
// allocator slack and gRPC, plus one receive buffer per concurrent stream, plus the idle buffers
// kvcd keeps for reuse (--buffer_pool_bytes), plus the staging of uploads in flight
// (--staging_bytes, which kvcd enforces), plus the CUDA context and pinned buffers on GPU pods.
const FIXED_OVERHEAD = 256 * 2 ** 20;
const CUDA_OVERHEAD = 512 * 2 ** 20;

const problems = [];
const problem = (where, what) => problems.push(`${where}: ${what}`);

function render() {
  if (args.file) return fs.readFileSync(args.file, 'utf8');
  if (!args.kustomize) lib.fail('give --kustomize=DIR or --file=FILE');
  const kubectl = args.kubectl || 'kubectl';
  let version = '';
  try {
    version = execFileSync(kubectl, ['version', '--client'], {
      encoding: 'utf8',
      stdio: ['ignore', 'pipe', 'pipe'],
    });
  } catch (e) {
    lib.fail(`cannot run '${kubectl} version --client': ${e.message}`);
  }
  const kustomize = /^Kustomize Version: v?(\d+)/m.exec(version);
  if (!kustomize || Number(kustomize[1]) < 4) {
    console.log(
      `SKIPPED: ${version.split('\n')[0]} embeds kustomize < v4; install kubectl >= 1.21`,
    );
    process.exit(77);
  }
  try {
    return execFileSync(kubectl, ['kustomize', args.kustomize], {
      encoding: 'utf8',
      stdio: ['ignore', 'pipe', 'pipe'],
    });
  } catch (e) {
    lib.fail(`kubectl kustomize ${args.kustomize} failed:\n${e.stderr || e.message}`);
  }
}

// apiVersion + kind -> the model class whose validate() holds the schema.
function modelFor(apiVersion, kind) {
  if (!/^[A-Za-z]+$/.test(kind || '')) return null;
  const candidates = [];
  if (String(apiVersion).startsWith('monitoring.coreos.com/')) {
    candidates.push(`@kubernetes-models/prometheus-operator/${apiVersion}/${kind}`);
  } else if (/^([a-z0-9.-]+\/)?v[0-9a-z]+$/.test(apiVersion || '')) {
    candidates.push(`kubernetes-models/${apiVersion}/${kind}`);
  }
  for (const c of candidates) {
    try {
      const mod = req(c);
      if (mod[kind]) return mod[kind];
    } catch (e) {
      if (e.code !== 'MODULE_NOT_FOUND') throw e;
    }
  }
  return null;
}

function validateSchema(objects) {
  for (const o of objects) {
    const where = `${o.kind || '?'}/${(o.metadata && o.metadata.name) || '?'}`;
    const Model = modelFor(o.apiVersion, o.kind);
    if (!Model) {
      problem(where, `no schema known for apiVersion '${o.apiVersion}' kind '${o.kind}'`);
      continue;
    }
    try {
      new Model(o).validate();
    } catch (e) {
      problem(where, `schema: ${e.message}`);
    }
  }
}

const matches = (selector, labels) =>
  Object.entries(selector || {}).every(([k, v]) => labels && labels[k] === v);

function lintDeployment(objects) {
  const deployments = objects.filter((o) => o.kind === 'Deployment');
  if (deployments.length !== 1) {
    problem('Deployment', `expected exactly one, found ${deployments.length}`);
    return null;
  }
  const d = deployments[0];
  const where = `Deployment/${d.metadata.name}`;
  const pod = (d.spec.template || {}).spec || {};
  const podLabels = (d.spec.template.metadata || {}).labels || {};
  if (!matches(d.spec.selector.matchLabels, podLabels)) {
    problem(where, 'spec.selector does not match the pod template labels');
  }
  const c = (pod.containers || []).find((x) => x.name === 'kvcd');
  if (!c) {
    problem(where, 'no container named kvcd');
    return null;
  }

  // Flags: the ConfigMap volume mounted where --flagfile points.
  const flagArg = (c.args || []).find((a) => a.startsWith('--flagfile='));
  let flags = null;
  if (!flagArg) {
    problem(where, 'container args have no --flagfile=');
  } else {
    const file = flagArg.slice('--flagfile='.length);
    const mount = (c.volumeMounts || []).find((m) => file.startsWith(`${m.mountPath}/`));
    const volume = mount && (pod.volumes || []).find((v) => v.name === mount.name);
    const cm =
      volume &&
      volume.configMap &&
      objects.find((o) => o.kind === 'ConfigMap' && o.metadata.name === volume.configMap.name);
    const key = mount && file.slice(mount.mountPath.length + 1);
    if (!cm || !cm.data || cm.data[key] === undefined) {
      problem(where, `${file} is not a key of a ConfigMap mounted at its directory`);
    } else {
      try {
        flags = lib.parseFlagfile(cm.data[key]);
      } catch (e) {
        problem(`ConfigMap/${cm.metadata.name}`, e.message);
      }
    }
  }

  // Security.
  const psc = pod.securityContext || {};
  const csc = c.securityContext || {};
  if (psc.runAsNonRoot !== true && csc.runAsNonRoot !== true)
    problem(where, 'runAsNonRoot is not true');
  const uid = csc.runAsUser !== undefined ? csc.runAsUser : psc.runAsUser;
  if (!(Number.isInteger(uid) && uid > 0))
    problem(where, `runAsUser must be a non-zero UID, got ${uid}`);
  if (csc.readOnlyRootFilesystem !== true) problem(where, 'readOnlyRootFilesystem is not true');
  if (csc.allowPrivilegeEscalation !== false)
    problem(where, 'allowPrivilegeEscalation is not false');
  if (csc.privileged === true) problem(where, 'container is privileged');
  if (!((csc.capabilities || {}).drop || []).includes('ALL'))
    problem(where, 'capabilities.drop lacks ALL');
  if ((csc.capabilities || {}).add && csc.capabilities.add.length)
    problem(where, 'capabilities.add is not empty');

  if (!flags) return { d, c, pod, podLabels, flags: null };

  // Ports and probes agree with the flags.
  const containerPort = (name) =>
    ((c.ports || []).find((p) => p.name === name) || {}).containerPort;
  for (const [flag, name] of [
    ['listen', 'grpc'],
    ['health_listen', 'health'],
    ['metrics_listen', 'metrics'],
  ]) {
    const addr = flags[flag];
    if (!addr) {
      problem(where, `flagfile does not set --${flag}`);
      continue;
    }
    if (addr.startsWith('127.') || addr.startsWith('localhost') || addr.startsWith('[::1]')) {
      problem(where, `--${flag}=${addr} is loopback: unreachable from the Service and kubelet`);
    }
    if (containerPort(name) !== lib.portOf(addr)) {
      problem(
        where,
        `container port '${name}' (${containerPort(name)}) != --${flag} port (${lib.portOf(addr)})`,
      );
    }
  }
  const healthPort = lib.portOf(flags.health_listen || '');
  for (const probe of ['startupProbe', 'livenessProbe', 'readinessProbe']) {
    const p = c[probe];
    if (!p || !p.grpc) {
      problem(where, `${probe} is not a gRPC probe`);
      continue;
    }
    if (p.grpc.port !== healthPort)
      problem(where, `${probe} port ${p.grpc.port} != health port ${healthPort}`);
  }

  // Shutdown fits the grace period.
  const drain = Number(flags.drain_seconds || 5) + Number(flags.shutdown_deadline_seconds || 10);
  const grace =
    pod.terminationGracePeriodSeconds === undefined ? 30 : pod.terminationGracePeriodSeconds;
  if (!(grace > drain))
    problem(
      where,
      `terminationGracePeriodSeconds ${grace} <= drain + shutdown deadline (${drain})`,
    );

  // Memory = store budget + overhead; requests = limits (Guaranteed QoS).
  const res = c.resources || {};
  const lim = res.limits || {};
  const rq = res.requests || {};
  for (const r of ['memory', 'cpu']) {
    if (lim[r] === undefined) problem(where, `no ${r} limit`);
    else if (lib.parseQuantity(rq[r]) !== lib.parseQuantity(lim[r])) {
      problem(where, `${r} request ${rq[r]} != limit ${lim[r]}`);
    }
  }
  // The overhead is stated on the pod template; it must cover the parts kvcd always needs.
  const mi = (b) => `${Math.ceil(b / 2 ** 20)}Mi`;
  const store = lib.parseByteSize(flags.store_bytes || '1GiB');
  const streams = Number(flags.max_concurrent_streams || 64);
  const message = lib.parseByteSize(flags.max_message_bytes || '8MiB');
  const cuda = flags.backend === 'cuda';
  const pool = lib.parseByteSize(flags.buffer_pool_bytes || '512MiB');
  // kvcd's defaults (server/config.h): max cache = store / 4, staging = max(store / 2, max cache).
  const maxCache = flags.max_cache_bytes
    ? lib.parseByteSize(flags.max_cache_bytes)
    : Math.max(1, Math.floor(store / 4));
  const staging = flags.staging_bytes
    ? lib.parseByteSize(flags.staging_bytes)
    : Math.max(Math.floor(store / 2), maxCache);
  if (staging < maxCache) {
    problem(
      where,
      `--staging_bytes ${mi(staging)} is below --max_cache_bytes ${mi(maxCache)} (kvcd refuses it)`,
    );
  }
  const minOverhead =
    FIXED_OVERHEAD + streams * message + pool + staging + (cuda ? CUDA_OVERHEAD : 0);
  const annotations = (d.spec.template.metadata || {}).annotations || {};
  const overheadText = annotations['kvc.dev/memory-overhead'];
  const overhead = lib.parseQuantity(overheadText);
  const memLimit = lib.parseQuantity(lim.memory);
  if (overheadText === undefined || !(overhead >= 0)) {
    problem(where, 'pod template lacks the kvc.dev/memory-overhead annotation');
  } else {
    if (overhead < minOverhead) {
      problem(
        where,
        `kvc.dev/memory-overhead ${overheadText} is below the minimum ${mi(minOverhead)} ` +
          `(256Mi fixed + ${streams} streams x ${mi(message)} + ${mi(pool)} buffer pool + ` +
          `${mi(staging)} staging${cuda ? ' + 512Mi CUDA' : ''})`,
      );
    }
    if (memLimit !== store + overhead) {
      problem(
        where,
        `memory limit ${lim.memory} != store ${flags.store_bytes} + overhead ` +
          `${overheadText} (${mi(store + overhead)})`,
      );
    }
  }
  const threads = Number(flags.threads || 0);
  if (threads > 0 && lim.cpu !== undefined && threads !== lib.parseQuantity(lim.cpu)) {
    problem(where, `--threads=${threads} differs from the CPU limit ${lim.cpu}`);
  }

  // GPU only where expected.
  const gpu = lib.parseQuantity(lim['nvidia.com/gpu'] || 0);
  if (args.expect === 'gpu') {
    if (!(gpu >= 1)) problem(where, 'GPU overlay without an nvidia.com/gpu limit');
    if (flags.backend !== 'cuda') problem(where, `GPU overlay runs --backend=${flags.backend}`);
    if (!pod.nodeSelector || !Object.keys(pod.nodeSelector).length)
      problem(where, 'GPU overlay without a nodeSelector');
    if (!(pod.tolerations || []).some((t) => String(t.key).startsWith('nvidia.com/'))) {
      problem(where, 'GPU overlay without an nvidia.com toleration');
    }
  } else {
    if (gpu > 0 || rq['nvidia.com/gpu'] !== undefined)
      problem(where, 'asks for nvidia.com/gpu outside the GPU overlay');
    if (flags.backend === 'cuda') problem(where, '--backend=cuda outside the GPU overlay');
  }
  return { d, c, pod, podLabels, flags };
}

function lintServices(objects, dep) {
  const services = objects.filter((o) => o.kind === 'Service');
  const headless = services.filter((s) => s.spec.clusterIP === 'None');
  const normal = services.filter((s) => s.spec.clusterIP !== 'None');
  if (headless.length !== 1)
    problem('Service', `expected one headless Service, found ${headless.length}`);
  if (normal.length !== 1)
    problem('Service', `expected one ClusterIP Service, found ${normal.length}`);
  const portNames = new Set(((dep && dep.c.ports) || []).map((p) => p.name));
  for (const s of services) {
    const where = `Service/${s.metadata.name}`;
    if (dep && !matches(s.spec.selector, dep.podLabels))
      problem(where, 'selector does not match the kvcd pods');
    const names = (s.spec.ports || []).map((p) => p.name);
    const want = s.spec.clusterIP === 'None' ? ['grpc'] : ['grpc', 'metrics'];
    for (const n of want) if (!names.includes(n)) problem(where, `no port named '${n}'`);
    for (const p of s.spec.ports || []) {
      if (typeof p.targetPort === 'string' && !portNames.has(p.targetPort)) {
        problem(where, `targetPort '${p.targetPort}' is not a container port name`);
      }
    }
  }
  for (const pdb of objects.filter((o) => o.kind === 'PodDisruptionBudget')) {
    if (dep && !matches(pdb.spec.selector.matchLabels, dep.podLabels)) {
      problem(`PodDisruptionBudget/${pdb.metadata.name}`, 'selector does not match the kvcd pods');
    }
  }
  if (!objects.some((o) => o.kind === 'PodDisruptionBudget'))
    problem('PodDisruptionBudget', 'missing');

  // ServiceMonitor: selects the metrics Service and names its port.
  const monitors = objects.filter((o) => o.kind === 'ServiceMonitor');
  if (monitors.length !== 1) problem('ServiceMonitor', `expected one, found ${monitors.length}`);
  for (const m of monitors) {
    const where = `ServiceMonitor/${m.metadata.name}`;
    const sel = m.spec.selector || {};
    const selected = services.filter(
      (s) =>
        matches(sel.matchLabels, s.metadata.labels) &&
        (sel.matchExpressions || []).every((e) => {
          const has = Object.prototype.hasOwnProperty.call(s.metadata.labels || {}, e.key);
          if (e.operator === 'DoesNotExist') return !has;
          if (e.operator === 'Exists') return has;
          const v = (s.metadata.labels || {})[e.key];
          return e.operator === 'In' ? (e.values || []).includes(v) : !(e.values || []).includes(v);
        }),
    );
    if (!selected.length) problem(where, 'selects no Service');
    for (const ep of m.spec.endpoints || []) {
      if (!ep.port) problem(where, 'endpoint without a named port');
      for (const s of selected) {
        if (!(s.spec.ports || []).some((p) => p.name === ep.port)) {
          problem(where, `selected Service/${s.metadata.name} has no port '${ep.port}'`);
        }
      }
    }
    if (!(m.spec.endpoints || []).length) problem(where, 'no endpoints');
  }
  const rules = objects.filter((o) => o.kind === 'PrometheusRule');
  if (rules.length !== 1) problem('PrometheusRule', `expected one, found ${rules.length}`);
  for (const r of rules) {
    for (const g of (r.spec && r.spec.groups) || []) {
      for (const rule of g.rules || []) {
        if (!rule.expr || !(rule.alert || rule.record)) {
          problem(
            `PrometheusRule/${r.metadata.name}`,
            `group ${g.name}: rule without expr or name`,
          );
        }
      }
    }
  }
}

const text = render();
let objects = [];
for (const doc of YAML.parseAllDocuments(text)) {
  if (doc.errors.length) lib.fail(`YAML: ${doc.errors[0].message}`);
  const o = doc.toJS();
  if (o !== null) objects.push(o);
}
if (!objects.length) lib.fail('no objects rendered');
validateSchema(objects);
if (args.kustomize) {
  const dep = lintDeployment(objects);
  lintServices(objects, dep);
}
const source = args.kustomize || args.file;
if (problems.length) {
  for (const p of problems) console.log(`FAIL: ${source}: ${p}`);
  console.log(`${source}: ${problems.length} problem(s) in ${objects.length} objects`);
  process.exit(1);
}
console.log(
  `ok: ${source}: ${objects.length} objects valid (` + `${objects.map((o) => o.kind).join(', ')})`,
);
