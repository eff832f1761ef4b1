// Renders a kustomization (or reads a YAML file), validates every object against the Kubernetes,
// Prometheus Operator and cert-manager schemas (kubernetes-models; no network, no cluster), then
// checks the kvcd-specific policy the deployment promises: non-root, read-only, no capabilities,
// gRPC probes on the health port, a grace period above drain + shutdown, memory = store +
// overhead, GPU only where expected, Services and monitors that select the pods, one namespace,
// and a NetworkPolicy that admits only labelled pods to the kvcd ports. With --secure: TLS and
// bearer tokens are on, from Secrets, the TLS one written by a cert-manager Certificate.
//
// Usage: node validate_manifests.cjs --modules=DIR (--kustomize=DIR [--kubectl=PATH] | --file=F)
//            [--expect=cpu|gpu] [--secure]
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
  } else if (String(apiVersion).startsWith('cert-manager.io/')) {
    candidates.push(`@kubernetes-models/cert-manager/${apiVersion}/${kind}`);
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
  // Flags given as container args after --flagfile override the file's, as kvcd reads them.
  for (const a of (c.args || []).slice((c.args || []).indexOf(flagArg) + 1)) {
    const m = /^--([A-Za-z0-9_]+)(?:=(.*))?$/s.exec(a);
    if (m) flags[m[1]] = m[2] === undefined ? 'true' : m[2];
  }

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

// Kinds that live outside namespaces (the ones these manifests could contain).
const CLUSTER_SCOPED = new Set(['Namespace', 'ClusterIssuer', 'ClusterRole', 'ClusterRoleBinding']);

function lintNamespaces(objects, dep) {
  if (!dep) return;
  const ns = dep.d.metadata.namespace;
  for (const o of objects) {
    if (CLUSTER_SCOPED.has(o.kind)) continue;
    if (o.metadata.namespace !== ns) {
      problem(
        `${o.kind}/${o.metadata.name}`,
        `namespace ${o.metadata.namespace} is not the Deployment's (${ns})`,
      );
    }
  }
}

// A label selector (matchLabels and matchExpressions) against a set of labels.
function selects(selector, labels) {
  const l = labels || {};
  return (
    matches((selector || {}).matchLabels, l) &&
    ((selector || {}).matchExpressions || []).every((e) => {
      const has = Object.prototype.hasOwnProperty.call(l, e.key);
      if (e.operator === 'Exists') return has;
      if (e.operator === 'DoesNotExist') return !has;
      const inValues = has && (e.values || []).includes(l[e.key]);
      return e.operator === 'In' ? inValues : !inValues;
    })
  );
}

const selectsSome = (selector) =>
  !!selector &&
  (Object.keys(selector.matchLabels || {}).length > 0 ||
    (selector.matchExpressions || []).length > 0);

// The NetworkPolicies that select the kvcd pods must admit to the gRPC and metrics ports only pods
// chosen by label (never every source, an address block of the whole internet, or every pod),
// and must admit someone to each (clients to grpc, Prometheus to metrics).
function lintNetworkPolicies(objects, dep) {
  if (!dep) return;
  const ns = dep.d.metadata.namespace;
  const policies = objects.filter(
    (o) =>
      o.kind === 'NetworkPolicy' &&
      o.metadata.namespace === ns &&
      selects((o.spec || {}).podSelector, dep.podLabels),
  );
  if (!policies.length) {
    problem('NetworkPolicy', 'none selects the kvcd pods: every pod in the cluster can reach them');
    return;
  }
  const containerPorts = (dep.c.ports || []).map((p) => ({
    name: p.name,
    number: p.containerPort,
  }));
  const covers = (rule, cp) =>
    !(rule.ports || []).length ||
    rule.ports.some((p) => {
      if (p.port === undefined) return true;
      if (typeof p.port === 'string') return p.port === cp.name;
      return p.endPort === undefined
        ? p.port === cp.number
        : cp.number >= p.port && cp.number <= p.endPort;
    });
  const admitted = new Set();
  let restrictsIngress = false;
  for (const pol of policies) {
    const where = `NetworkPolicy/${pol.metadata.name}`;
    const types = pol.spec.policyTypes || ['Ingress'];
    if (!types.includes('Ingress')) continue;
    restrictsIngress = true;
    (pol.spec.ingress || []).forEach((rule, i) => {
      for (const p of rule.ports || []) {
        if (typeof p.port === 'string' && !containerPorts.some((cp) => cp.name === p.port)) {
          problem(where, `ingress rule ${i + 1}: port '${p.port}' is not a container port name`);
        }
      }
      const ports = containerPorts.filter((cp) => covers(rule, cp));
      if (!ports.length) return;
      const names = ports.map((cp) => cp.name).join(', ');
      const peers = rule.from || [];
      if (!peers.length) problem(where, `ingress rule ${i + 1} admits every source to ${names}`);
      for (const peer of peers) {
        if (peer.ipBlock) {
          if (['0.0.0.0/0', '::/0'].includes(peer.ipBlock.cidr)) {
            problem(where, `ingress rule ${i + 1} admits ${peer.ipBlock.cidr} to ${names}`);
          }
        } else if (!selectsSome(peer.podSelector)) {
          problem(where, `ingress rule ${i + 1} admits pods not chosen by label to ${names}`);
        }
      }
      for (const cp of ports) admitted.add(cp.name);
    });
  }
  if (!restrictsIngress) problem('NetworkPolicy', 'none restricts ingress to the kvcd pods');
  for (const [name, who] of [
    ['grpc', 'clients'],
    ['metrics', 'Prometheus'],
  ]) {
    if (restrictsIngress && !admitted.has(name)) {
      problem('NetworkPolicy', `no rule admits ${who} to port ${name}`);
    }
  }
}

// --secure: TLS (mutual) and bearer tokens are on, their files come from Secrets that are
// required, the TLS Secret is written by a cert-manager Certificate naming every Service, and no
// token Secret is committed with the manifests.
function lintSecure(objects, dep) {
  if (!dep || !dep.flags) return;
  const { d, c, pod, flags } = dep;
  const where = `Deployment/${d.metadata.name}`;
  const secretFile = (flag) => {
    const file = flags[flag];
    const mount = (c.volumeMounts || []).find((m) => file.startsWith(`${m.mountPath}/`));
    const volume = mount && (pod.volumes || []).find((v) => v.name === mount.name);
    if (!volume || !volume.secret) {
      problem(where, `secure: --${flag}=${file} is not in a mounted Secret`);
      return null;
    }
    if (volume.secret.optional === true) {
      problem(where, `secure: the Secret of --${flag} is optional: pods would start without it`);
    }
    return { name: volume.secret.secretName, key: file.slice(mount.mountPath.length + 1) };
  };
  const files = {};
  for (const flag of ['tls_cert_file', 'tls_key_file', 'tls_client_ca_file', 'auth_tokens_file']) {
    if (!flags[flag]) problem(where, `secure: --${flag} is not set`);
    else files[flag] = secretFile(flag);
  }
  if (flags.tls_reload_seconds === '0') {
    problem(where, 'secure: --tls_reload_seconds=0 never picks up a renewed certificate');
  }
  const tls = files.tls_cert_file;
  if (tls) {
    // cert-manager writes tls.crt, tls.key and ca.crt into the Certificate's Secret.
    for (const [flag, key] of [
      ['tls_cert_file', 'tls.crt'],
      ['tls_key_file', 'tls.key'],
      ['tls_client_ca_file', 'ca.crt'],
    ]) {
      const f = files[flag];
      if (f && (f.name !== tls.name || f.key !== key)) {
        problem(where, `secure: --${flag} is not key ${key} of Secret ${tls.name}`);
      }
    }
    const certs = objects.filter(
      (o) =>
        o.kind === 'Certificate' &&
        String(o.apiVersion).startsWith('cert-manager.io/') &&
        (o.spec || {}).secretName === tls.name,
    );
    if (!certs.length) {
      problem(where, `secure: no cert-manager Certificate writes Secret ${tls.name}`);
    }
    const ns = d.metadata.namespace;
    for (const cert of certs) {
      const names = cert.spec.dnsNames || [];
      for (const s of objects.filter((o) => o.kind === 'Service')) {
        const dns = `${s.metadata.name}.${ns}.svc`;
        if (!names.includes(dns)) {
          problem(`Certificate/${cert.metadata.name}`, `dnsNames lack ${dns} (Service)`);
        }
      }
      if (cert.spec.usages && !cert.spec.usages.includes('server auth')) {
        problem(`Certificate/${cert.metadata.name}`, `usages lack 'server auth'`);
      }
    }
  }
  const tokens = files.auth_tokens_file;
  if (tokens && objects.some((o) => o.kind === 'Secret' && o.metadata.name === tokens.name)) {
    problem(
      `Secret/${tokens.name}`,
      'holds the bearer tokens and is part of the manifests: create it in the cluster instead',
    );
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
  lintNamespaces(objects, dep);
  lintNetworkPolicies(objects, dep);
  if (args.secure) lintSecure(objects, dep);
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
