// Checks the deployment against a live kvcd binary, on loopback with ephemeral ports.
//
//   --mode=metrics --kvcd=BIN --modules=DIR --rules=F[,F] --dashboard=F[,F]
//     Every vector selector in the alert rules and the dashboard names a series kvcd exports
//     (histograms only through _bucket/_sum/_count), every label it matches on exists on that
//     series, and every literal label value it asks for is one kvcd exports (kvcd creates all
//     label children at start, so a fresh process shows them all). Prometheus' target labels
//     (job, instance, namespace, pod, ...) are not kvcd's and are skipped. Also: kvcd's idle
//     resident memory fits the fixed overhead the manifests budget above the store.
//   --mode=health --kvcd=BIN --probe=BIN --modules=DIR --deployment=F
//     Every gRPC probe of the kvcd container in deployment F answers SERVING on kvcd's health port
//     (asked by BIN, a grpc.health.v1 client like kubelet's), and an unknown service does not.
//   --mode=flags --kvcd=BIN --flagfiles=F[,F] --docs=F[,F]
//     kvcd starts with each flagfile (addresses and store moved to loopback/small), and every
//     --flag named in the docs is one `kvcd --helpfull` lists.
'use strict';
const fs = require('fs');
const http = require('http');
const { spawn, spawnSync } = require('child_process');
const lib = require('./lib.cjs');
const { selectors } = require('./promql.cjs');

const args = lib.parseArgs(process.argv.slice(2));
const list = (v) => (typeof v === 'string' && v ? v.split(',') : []);
if (!args.kvcd || !fs.existsSync(args.kvcd)) lib.fail(`kvcd binary '${args.kvcd}' not found`);

// Same number as validate_manifests.cjs' FIXED_OVERHEAD.
const FIXED_OVERHEAD = 256 * 2 ** 20;
const TARGET_LABELS = new Set([
  'job',
  'instance',
  'namespace',
  'pod',
  'service',
  'endpoint',
  'container',
  'node',
]);
const LOOPBACK = ['--listen=127.0.0.1:0', '--health_listen=', '--metrics_listen=127.0.0.1:0'];

// Starts kvcd and resolves with {proc, metricsUrl} once it prints its metrics address.
function startKvcd(extraArgs) {
  return new Promise((resolve, reject) => {
    const proc = spawn(args.kvcd, extraArgs, { stdio: ['ignore', 'pipe', 'pipe'] });
    let output = '';
    const timer = setTimeout(() => {
      proc.kill('SIGKILL');
      reject(new Error(`kvcd did not print its metrics address within 30 s:\n${output}`));
    }, 30000);
    const onData = (chunk) => {
      output += chunk;
      const m = /kvcd: metrics on (http:\/\/\S+\/metrics)/.exec(output);
      const h = /kvcd: health on (\S+)/.exec(output);
      if (m) {
        clearTimeout(timer);
        resolve({ proc, metricsUrl: m[1], healthAddress: h && h[1], output: () => output });
      }
    };
    proc.stdout.on('data', onData);
    proc.stderr.on('data', onData);
    proc.on('exit', (code, signal) => {
      clearTimeout(timer);
      reject(
        new Error(
          `kvcd ${extraArgs.join(' ')} exited (${code ?? signal}) before serving:\n${output}`,
        ),
      );
    });
  });
}

// kvcd takes SIGTERM in its main thread's sigwait; threads that libraries start before main
// (OpenBLAS's pool) do not block it, so a SIGTERM sent before main waits can kill the process.
// Wait (up to 5 s) until the kernel shows the main thread in the signal wait.
async function untilWaitingForSignals(pid) {
  for (let i = 0; i < 500; i++) {
    let wchan = '';
    try {
      wchan = fs.readFileSync(`/proc/${pid}/wchan`, 'utf8');
    } catch (e) {
      break; // no procfs: fall back to a pause
    }
    if (/sigtimedwait|sigwait/.test(wchan)) return;
    if (wchan === '0' || wchan === '') break; // wchan hidden: fall back to a pause
    await new Promise((r) => setTimeout(r, 10));
  }
  await new Promise((r) => setTimeout(r, 300));
}

async function stopKvcd(k) {
  await untilWaitingForSignals(k.proc.pid);
  return new Promise((resolve) => {
    k.proc.removeAllListeners('exit');
    const timer = setTimeout(() => k.proc.kill('SIGKILL'), 20000);
    k.proc.on('exit', (code, signal) => {
      clearTimeout(timer);
      resolve(code ?? signal);
    });
    k.proc.kill('SIGTERM');
  });
}

function get(url) {
  return new Promise((resolve, reject) => {
    http
      .get(url, (res) => {
        let body = '';
        res.setEncoding('utf8');
        res.on('data', (c) => {
          body += c;
        });
        res.on('end', () =>
          res.statusCode === 200
            ? resolve(body)
            : reject(new Error(`GET ${url}: HTTP ${res.statusCode}`)),
        );
      })
      .on('error', reject);
  });
}

// Prometheus text format -> {types: name->type, series: name->[labels]}.
function parseExposition(text) {
  const types = new Map();
  const series = new Map();
  for (const line of text.split('\n')) {
    const t = /^# TYPE (\S+) (\S+)/.exec(line);
    if (t) {
      types.set(t[1], t[2]);
      continue;
    }
    if (line === '' || line.startsWith('#')) continue;
    const m = /^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+\S+/.exec(line);
    if (!m) throw new Error(`unparseable exposition line '${line}'`);
    const labels = {};
    for (const l of (m[2] || '').matchAll(/([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"/g)) {
      labels[l[1]] = l[2];
    }
    if (!series.has(m[1])) series.set(m[1], []);
    series.get(m[1]).push(labels);
  }
  return { types, series };
}

// [{source, expr}] from the rules files and dashboards.
function expressions(req) {
  const exprs = [];
  const YAML = req('yaml');
  for (const file of list(args.rules)) {
    const doc = YAML.parse(fs.readFileSync(file, 'utf8'));
    const groups = (doc && (doc.groups || (doc.spec && doc.spec.groups))) || [];
    for (const g of groups) {
      for (const r of g.rules || []) {
        exprs.push({ source: `${file}: ${r.alert || r.record}`, expr: String(r.expr) });
      }
    }
  }
  for (const file of list(args.dashboard)) {
    const d = JSON.parse(fs.readFileSync(file, 'utf8'));
    const panels = (d.panels || []).flatMap((p) => [p, ...(p.panels || [])]);
    for (const p of panels) {
      for (const t of p.targets || []) {
        if (t.expr) exprs.push({ source: `${file}: panel '${p.title}'`, expr: t.expr });
      }
    }
    for (const v of (d.templating && d.templating.list) || []) {
      const q = typeof v.query === 'object' && v.query ? v.query.query : v.query;
      const lv = /^label_values\((.*),\s*[A-Za-z_][A-Za-z0-9_]*\s*\)$/.exec(String(q || '').trim());
      if (v.type === 'query') {
        if (!lv) throw new Error(`${file}: variable '${v.name}': expected label_values(...)`);
        exprs.push({ source: `${file}: variable '${v.name}'`, expr: lv[1] });
      }
    }
  }
  if (!exprs.length) throw new Error('no expressions found in --rules / --dashboard');
  return exprs;
}

function checkSelector(source, sel, exported, problems) {
  const { types, series } = exported;
  let samples = series.get(sel.name);
  if (!samples) {
    const base = sel.name.replace(/_(bucket|sum|count)$/, '');
    const hint =
      types.get(sel.name) === 'histogram'
        ? ` (a histogram: query ${sel.name}_bucket, _sum or _count)`
        : types.has(base)
          ? ` (${base} is a ${types.get(base)})`
          : '';
    problems.push(`${source}: unknown metric ${sel.name}${hint}`);
    return;
  }
  for (const m of sel.matchers) {
    if (TARGET_LABELS.has(m.label)) continue;
    if (m.label === 'le' && sel.name.endsWith('_bucket')) continue;
    if (!samples.some((s) => m.label in s)) {
      problems.push(`${source}: ${sel.name} has no label '${m.label}'`);
      continue;
    }
    const values = new Set(samples.map((s) => s[m.label]));
    let wanted = [];
    if (m.op === '=' || m.op === '!=') wanted = [m.value];
    else if (/^[A-Za-z0-9_]+(\|[A-Za-z0-9_]+)*$/.test(m.value)) wanted = m.value.split('|');
    for (const w of wanted) {
      if (!values.has(w)) {
        problems.push(
          `${source}: ${sel.name}{${m.label}${m.op}"${m.value}"}: kvcd exports no ` +
            `${m.label}="${w}" (it has: ${[...values].sort().join(', ')})`,
        );
      }
    }
  }
}

async function metricsMode() {
  const req = lib.modulesRequire(args.modules);
  const exprs = expressions(req);
  const k = await startKvcd([...LOOPBACK, '--store_bytes=64MiB']);
  let text;
  let rss = NaN;
  try {
    text = await get(k.metricsUrl);
    const status = fs.readFileSync(`/proc/${k.proc.pid}/status`, 'utf8');
    rss = Number((/VmRSS:\s+(\d+) kB/.exec(status) || [])[1]) * 1024;
  } finally {
    await stopKvcd(k);
  }
  const exported = parseExposition(text);
  const problems = [];
  let count = 0;
  for (const { source, expr } of exprs) {
    let sels;
    try {
      sels = selectors(expr);
    } catch (e) {
      problems.push(`${source}: cannot scan expression: ${e.message}`);
      continue;
    }
    if (!sels.length) problems.push(`${source}: no metric in '${expr}'`);
    for (const s of sels) {
      checkSelector(source, s, exported, problems);
      count++;
    }
  }
  if (!(rss > 0)) problems.push('could not read kvcd resident memory');
  else if (rss > FIXED_OVERHEAD) {
    problems.push(
      `kvcd idle RSS ${(rss / 2 ** 20).toFixed(0)}Mi exceeds the manifests' 256Mi fixed overhead`,
    );
  }
  if (problems.length) {
    for (const p of problems) console.log(`FAIL: ${p}`);
    process.exit(1);
  }
  console.log(
    `ok: ${count} selectors in ${exprs.length} expressions match the ${exported.series.size} ` +
      `series names kvcd exports; idle RSS ${(rss / 2 ** 20).toFixed(1)}Mi`,
  );
}

async function flagsMode() {
  const problems = [];
  // absl prints the flags and exits non-zero after --helpfull.
  const run = spawnSync(args.kvcd, ['--helpfull'], { encoding: 'utf8', timeout: 10000 });
  const help = `${run.stdout || ''}${run.stderr || ''}`;
  const known = new Set([...help.matchAll(/^\s+--([A-Za-z0-9_]+)\s/gm)].map((m) => m[1]));
  if (!known.has('store_bytes')) lib.fail(`kvcd --helpfull lists no --store_bytes:\n${help}`);
  for (const file of list(args.docs)) {
    const text = fs.readFileSync(file, 'utf8');
    let names = [];
    if (/Dockerfile$/.test(file)) {
      // The flags the image passes to kvcd: its ENTRYPOINT and CMD (exec form).
      for (const m of text.matchAll(/^(?:ENTRYPOINT|CMD)\s+(\[.*\])\s*$/gm)) {
        names.push(...JSON.parse(m[1]).filter((a) => a.startsWith('--')));
      }
    } else {
      // Prose and examples; command lines of other tools keep their own options.
      for (const line of text.split('\n')) {
        if (
          /^\s*(\$\s*)?(docker|kubectl|promtool|ctest|cmake|npm|python3|kustomize|helm)\s/.test(
            line,
          )
        )
          continue;
        names.push(...[...line.matchAll(/(?<![\w-])--[a-z][a-z0-9_]*(?![\w-])/g)].map((m) => m[0]));
      }
    }
    for (const name of names) {
      const flag = name.replace(/^--/, '').replace(/=.*$/s, '');
      if (!known.has(flag)) problems.push(`${file}: names --${flag}, which kvcd does not have`);
    }
  }
  for (const file of list(args.flagfiles)) {
    try {
      lib.parseFlagfile(fs.readFileSync(file, 'utf8'));
      // Later flags override the file's: loopback ports, a small store, the CPU backend.
      const k = await startKvcd([
        `--flagfile=${file}`,
        ...LOOPBACK,
        '--store_bytes=64MiB',
        '--backend=cpu',
      ]);
      // A scrape proves the configuration serves.
      try {
        await get(k.metricsUrl);
      } catch (e) {
        problems.push(`${file}: ${e.message}`);
      }
      const code = await stopKvcd(k);
      if (code !== 0 || !/kvcd: stopped/.test(k.output())) {
        problems.push(`${file}: kvcd did not drain and stop cleanly on SIGTERM (exit ${code})`);
      }
    } catch (e) {
      problems.push(`${file}: ${e.message}`);
    }
  }
  if (problems.length) {
    for (const p of [...new Set(problems)]) console.log(`FAIL: ${p}`);
    process.exit(1);
  }
  console.log(
    `ok: ${list(args.flagfiles).length} flagfiles start kvcd; every flag in ` +
      `${list(args.docs).join(', ')} is one of kvcd's ${known.size} flags`,
  );
}

async function healthMode() {
  const YAML = lib.modulesRequire(args.modules)('yaml');
  const dep = YAML.parse(fs.readFileSync(args.deployment, 'utf8'));
  const c = dep.spec.template.spec.containers.find((x) => x.name === 'kvcd');
  const probes = ['startupProbe', 'livenessProbe', 'readinessProbe'].filter(
    (p) => c[p] && c[p].grpc,
  );
  if (!probes.length) lib.fail(`${args.deployment}: the kvcd container has no gRPC probes`);
  const k = await startKvcd([
    '--listen=127.0.0.1:0',
    '--health_listen=127.0.0.1:0',
    '--metrics_listen=127.0.0.1:0',
    '--store_bytes=64MiB',
  ]);
  const problems = [];
  const ask = (service) =>
    spawnSync(args.probe, [k.healthAddress, service], { encoding: 'utf8', timeout: 15000 });
  try {
    if (!k.healthAddress) throw new Error(`kvcd did not print its health address:\n${k.output()}`);
    for (const p of probes) {
      const service = c[p].grpc.service || '';
      const r = ask(service);
      if (r.status !== 0)
        problems.push(`${p} (service '${service}'): ${(r.stdout + r.stderr).trim()}`);
      else console.log(`${p}: ${r.stdout.trim()}`);
    }
    const bogus = ask('no.such.Service');
    if (bogus.status === 0)
      problems.push(`an unknown service answers SERVING: the probe proves nothing`);
  } finally {
    await stopKvcd(k);
  }
  if (problems.length) {
    for (const p of problems) console.log(`FAIL: ${args.deployment}: ${p}`);
    process.exit(1);
  }
  console.log(`ok: ${probes.length} gRPC probes of ${args.deployment} pass against kvcd`);
}

(args.mode === 'metrics'
  ? metricsMode()
  : args.mode === 'flags'
    ? flagsMode()
    : args.mode === 'health'
      ? healthMode()
      : Promise.reject(new Error('--mode must be metrics, health or flags'))
).catch((e) => lib.fail(e.message));
