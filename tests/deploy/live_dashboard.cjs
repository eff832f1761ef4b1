// The dashboard and alert rules against a live Prometheus: starts kvcd and Prometheus on loopback
// (ephemeral ports; Prometheus scrapes kvcd every second as job "kvcd" with the target labels
// namespace and pod a Kubernetes scrape adds, and loads the alert rules), puts kvcd under a short
// bounded load (kvcctl bench, plus unary calls and cache misses), then asks Prometheus's HTTP API
//   - every query of every dashboard panel over the load (Grafana's variables filled in): no
//     error, and data (each panel shows something: kvcd exports all its series from the start);
//   - every template variable (label_values): the scraped namespace and pod;
//   - every alert rule: Prometheus evaluates it without error; every series it selects has data;
//     and where the rule is "value > threshold", the value has data.
// With --screenshot=PNG (and --chromium=BIN), also photographs Prometheus's graph page of kvc's
// main metrics (ingest rate, stored bytes, compression ratio, request rate by code).
//
// Usage: node live_dashboard.cjs --kvcd=BIN --kvcctl=BIN --prometheus=BIN --rules=FILE
//          --dashboard=FILE [--load_seconds=15] [--screenshot=PNG --chromium=BIN]
'use strict';
const fs = require('fs');
const net = require('net');
const os = require('os');
const path = require('path');
const http = require('http');
const { spawn, spawnSync } = require('child_process');
const lib = require('./lib.cjs');
const { selectors } = require('./promql.cjs');

const args = lib.parseArgs(process.argv.slice(2));
for (const a of ['kvcd', 'kvcctl', 'prometheus', 'rules', 'dashboard']) {
  if (!args[a]) lib.fail(`--${a} is required`);
}
const LOAD_SECONDS = Number(args.load_seconds || 15);
const NAMESPACE = 'kvc-live';
const POD = 'kvcd-0';
const RATE_INTERVAL = '10s'; // Grafana's $__rate_interval for a 1 s scrape, with room to spare
const work = fs.mkdtempSync(path.join(os.tmpdir(), 'kvc-live-'));
const children = [];
const problems = [];
const problem = (p) => problems.push(p);

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// An error that stops until() at once (a process exited) instead of being retried.
class Fatal extends Error {}

// Polls fn (async, returns a truthy value when done) every 250 ms until deadline_s passes.
async function until(what, fn, deadlineS = 60) {
  const end = Date.now() + deadlineS * 1000;
  let last;
  for (;;) {
    try {
      const v = await fn();
      if (v) return v;
    } catch (e) {
      if (e instanceof Fatal) throw e;
      last = e;
    }
    if (Date.now() > end) {
      throw new Error(`${what} within ${deadlineS} s${last ? `: ${last.message}` : ''}`);
    }
    await sleep(250);
  }
}

function start(name, bin, argv) {
  const proc = spawn(bin, argv, { stdio: ['ignore', 'pipe', 'pipe'] });
  let output = '';
  proc.stdout.on('data', (c) => (output += c));
  proc.stderr.on('data', (c) => (output += c));
  const child = { name, proc, output: () => output, exited: null };
  proc.on('exit', (code, signal) => (child.exited = code ?? signal));
  children.push(child);
  return child;
}

function getJson(url) {
  return new Promise((resolve, reject) => {
    http
      .get(url, (res) => {
        let body = '';
        res.setEncoding('utf8');
        res.on('data', (c) => (body += c));
        res.on('end', () => {
          try {
            resolve({ status: res.statusCode, body: JSON.parse(body) });
          } catch (e) {
            const error = body.slice(0, 200);
            resolve({ status: res.statusCode, body: { status: 'error', error } });
          }
        });
      })
      .on('error', reject);
  });
}

function freePort() {
  return new Promise((resolve, reject) => {
    const s = net.createServer();
    s.on('error', reject);
    s.listen(0, '127.0.0.1', () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });
}

function cleanup() {
  for (const c of children) if (c.exited === null) c.proc.kill('SIGKILL');
  fs.rmSync(work, { recursive: true, force: true });
}

// Grafana's variables, as the dashboard would have them for the scraped kvcd.
function fillVariables(expr) {
  const out = expr
    .replace(/\$\{?namespace\}?/g, NAMESPACE)
    .replace(/\$\{?pod\}?/g, POD)
    .replace(/\$\{?__rate_interval\}?|\$\{?__interval\}?/g, RATE_INTERVAL)
    .replace(/\$\{?__range\}?/g, '1m');
  if (/\$/.test(out)) throw new Error(`unknown Grafana variable in '${expr}'`);
  return out;
}

function selectorText(s) {
  const m = s.matchers.map((x) => `${x.label}${x.op}${JSON.stringify(x.value)}`);
  return `${s.name}{${m.join(', ')}}`;
}

async function main() {
  // --- kvcd ----------------------------------------------------------------------------------
  const portFile = path.join(work, 'kvcd.port');
  const kvcd = start('kvcd', args.kvcd, [
    '--listen=127.0.0.1:0',
    '--health_listen=',
    '--metrics_listen=127.0.0.1:0',
    `--port_file=${portFile}`,
    '--store_bytes=64MiB',
    // The bench uploads 16.5 MiB caches, two at a time: above the default per-cache limit of a
    // quarter of this small store.
    '--max_cache_bytes=32MiB',
    '--staging_bytes=64MiB',
    '--buffer_pool_bytes=16MiB',
    '--threads=2',
  ]);
  const metricsUrl = await until('kvcd prints its metrics address', () => {
    if (kvcd.exited !== null) throw new Fatal(`kvcd exited (${kvcd.exited}):\n${kvcd.output()}`);
    const m = /kvcd: metrics on (http:\/\/\S+)\/metrics/.exec(kvcd.output());
    return m && m[1];
  });
  const grpc = await until('kvcd writes --port_file', () => {
    const t = fs.existsSync(portFile) ? fs.readFileSync(portFile, 'utf8').trim() : '';
    return t;
  });

  // --- Prometheus ------------------------------------------------------------------------------
  const config = {
    global: { scrape_interval: '1s', evaluation_interval: '1s' },
    rule_files: [path.resolve(args.rules)],
    scrape_configs: [
      {
        job_name: 'kvcd',
        static_configs: [
          {
            targets: [metricsUrl.replace('http://', '')],
            labels: { namespace: NAMESPACE, pod: POD },
          },
        ],
      },
    ],
  };
  fs.writeFileSync(path.join(work, 'prometheus.yml'), JSON.stringify(config, null, 2));
  // Prometheus cannot listen on port 0 and say which port it got: take a free port, and try
  // again should another process take it first.
  let prom;
  for (let attempt = 1; !prom; attempt++) {
    const url = `http://127.0.0.1:${await freePort()}`;
    const prometheus = start('prometheus', args.prometheus, [
      `--config.file=${path.join(work, 'prometheus.yml')}`,
      `--storage.tsdb.path=${path.join(work, 'data')}`,
      `--web.listen-address=${url.replace('http://', '')}`,
      '--log.level=warn',
    ]);
    try {
      await until('Prometheus scrapes kvcd', async () => {
        if (prometheus.exited !== null) {
          throw new Fatal(`prometheus exited (${prometheus.exited}):\n${prometheus.output()}`);
        }
        const r = await getJson(`${url}/api/v1/targets`);
        const t = r.body.data && r.body.data.activeTargets;
        return t && t.length === 1 && t[0].health === 'up';
      });
      prom = url;
    } catch (e) {
      if (attempt >= 3 || !/address already in use/.test(prometheus.output())) throw e;
    }
  }
  console.log(`prometheus ${prom} scrapes kvcd ${metricsUrl} (gRPC ${grpc})`);

  // --- bounded load ------------------------------------------------------------------------------
  // Two phases of kvcctl bench (put, get, delete) with different compression; in the second,
  // caches that stay (kvcctl put, one a second) make the store grow. The graphs show the change.
  const cacheFile = path.join(work, 'cache.safetensors');
  const gen = spawnSync(
    'python3',
    [path.join(__dirname, '..', 'bench', 'make_llama_safetensors.py'), '512', '2', cacheFile],
    { encoding: 'utf8', timeout: 60000 },
  );
  if (gen.status !== 0) lib.fail(`make_llama_safetensors.py failed: ${gen.stderr || gen.error}`);
  const loadStart = Date.now() / 1000;
  const phases = [
    ['--concurrency=2', '--policy=snapkv', '--ratio=0.25', '--bits=4'],
    ['--concurrency=1', '--policy=h2o', '--ratio=0.5', '--bits=8'],
  ];
  let kept = 0;
  for (const phase of phases) {
    const bench = start('kvcctl bench', args.kvcctl, [
      `--target=${grpc}`,
      'bench',
      `--duration=${LOAD_SECONDS / phases.length}`,
      '--tokens=2048',
      '--layers=2',
      ...phase,
    ]);
    // Unary calls (the unary latency alert selects them) and cache misses (NOT_FOUND), spread
    // over the load.
    const phaseEnd = Date.now() / 1000 + LOAD_SECONDS + 120;
    while (bench.exited === null) {
      const calls = [['info'], ['ls'], ['stat', 'no-such-cache']];
      if (phase === phases[1]) {
        calls.push(['put', cacheFile, `--id=kept-${kept++}`, ...phase.slice(1)]);
      }
      for (const argv of calls) {
        spawnSync(args.kvcctl, [`--target=${grpc}`, ...argv], { timeout: 30000 });
      }
      await sleep(1000);
      if (Date.now() / 1000 > phaseEnd) lib.fail('kvcctl bench did not end');
    }
    if (bench.exited !== 0) lib.fail(`kvcctl bench failed (${bench.exited}):\n${bench.output()}`);
    for (const line of bench.output().split('\n')) {
      if (/^(bench|put|get|\s+errors)\b/.test(line)) console.log(line);
    }
  }
  const loadEnd = Date.now() / 1000;
  // Two scrapes after the load, so every rate covers it.
  await until('Prometheus scrapes after the load', async () => {
    const q = new URLSearchParams({ query: 'timestamp(up{job="kvcd"})' });
    const r = await getJson(`${prom}/api/v1/query?${q}`);
    const v = r.body.data && r.body.data.result[0];
    return v && Number(v.value[1]) > loadEnd + 1;
  });
  const end = Date.now() / 1000;

  // --- dashboard queries -------------------------------------------------------------------------
  let queries = 0;
  for (const file of args.dashboard.split(',')) {
    const d = JSON.parse(fs.readFileSync(file, 'utf8'));
    const panels = (d.panels || []).flatMap((p) => [p, ...(p.panels || [])]);
    for (const p of panels) {
      for (const t of p.targets || []) {
        if (!t.expr) continue;
        queries++;
        const where = `${path.basename(file)}: panel ${p.id} '${p.title}' ${t.refId}`;
        let expr;
        try {
          expr = fillVariables(t.expr);
        } catch (e) {
          problem(`${where}: ${e.message}`);
          continue;
        }
        const q = new URLSearchParams({ query: expr, start: loadStart, end, step: '2' });
        const r = await getJson(`${prom}/api/v1/query_range?${q}`);
        if (r.body.status !== 'success') {
          problem(`${where}: Prometheus error: ${r.body.error}\n  ${expr}`);
          continue;
        }
        const samples = r.body.data.result.reduce((n, s) => n + s.values.length, 0);
        if (!samples) problem(`${where}: no data under load\n  ${expr}`);
        else console.log(`ok: ${where}: ${r.body.data.result.length} series, ${samples} samples`);
      }
    }
    // Template variables: label_values(selector, label) as Grafana asks Prometheus.
    for (const v of (d.templating && d.templating.list) || []) {
      if (v.type !== 'query') continue;
      const text = typeof v.query === 'string' ? v.query : v.query && v.query.query;
      const m = /^label_values\((?:(.*),\s*)?([A-Za-z_][A-Za-z0-9_]*)\)$/.exec(text || '');
      if (!m) {
        problem(`variable '${v.name}': query '${text}' is not label_values(...)`);
        continue;
      }
      const q = new URLSearchParams({ start: loadStart, end });
      if (m[1]) q.append('match[]', fillVariables(m[1]));
      const r = await getJson(`${prom}/api/v1/label/${m[2]}/values?${q}`);
      const want = { namespace: NAMESPACE, pod: POD }[m[2]];
      if (r.body.status !== 'success') problem(`variable '${v.name}': ${r.body.error}`);
      else if (want && !r.body.data.includes(want)) {
        problem(`variable '${v.name}': ${text} gives ${JSON.stringify(r.body.data)}, not ${want}`);
      } else console.log(`ok: variable '${v.name}': ${JSON.stringify(r.body.data)}`);
    }
  }

  // --- alert rules -------------------------------------------------------------------------------
  const rules = await getJson(`${prom}/api/v1/rules?type=alert`);
  const loaded = (rules.body.data ? rules.body.data.groups : []).flatMap((g) => g.rules);
  if (!loaded.length) problem(`Prometheus loaded no alert rules from ${args.rules}`);
  for (const rule of loaded) {
    const where = `alert ${rule.name}`;
    const before = problems.length;
    if (rule.health !== 'ok') problem(`${where}: rule health ${rule.health}: ${rule.lastError}`);
    const now = new URLSearchParams({ query: rule.query, time: end });
    const r = await getJson(`${prom}/api/v1/query?${now}`);
    if (r.body.status !== 'success') {
      problem(`${where}: Prometheus error: ${r.body.error}`);
      continue;
    }
    for (const s of selectors(rule.query)) {
      const q = new URLSearchParams({ query: selectorText(s), time: end });
      const sr = await getJson(`${prom}/api/v1/query?${q}`);
      if (sr.body.status !== 'success' || !sr.body.data.result.length) {
        problem(`${where}: ${selectorText(s)} has no data`);
      }
    }
    // "value > threshold": the value itself must have data, or the alert could never fire.
    const value = rule.query.replace(/\s*(>|<|>=|<=|==|!=)\s*[0-9.eE+-]+\s*$/, '');
    if (value !== rule.query && !/\s(>|<|>=|<=|==|!=)\s|\b(and|unless)\b/.test(value)) {
      const q = new URLSearchParams({ query: value, time: end });
      const vr = await getJson(`${prom}/api/v1/query?${q}`);
      if (vr.body.status !== 'success' || !vr.body.data.result.length) {
        problem(`${where}: its value has no data under load\n  ${value.replace(/\s+/g, ' ')}`);
      }
    }
    if (problems.length === before) console.log(`ok: ${where}: ${rule.state}, inputs have data`);
  }

  if (args.screenshot) await screenshot(prom, loadStart);

  if (problems.length) {
    for (const p of problems) console.log(`FAIL: ${p}`);
    return 1;
  }
  console.log(`ok: ${queries} dashboard queries with data, ${loaded.length} alert rules evaluated`);
  return 0;
}

// Prometheus's graph page, one graph per main metric, over the load.
async function screenshot(prom, from) {
  if (!args.chromium) lib.fail('--screenshot needs --chromium=BIN');
  const sel = `{namespace="${NAMESPACE}", pod=~"${POD}"}`;
  const graphs = [
    `sum(rate(kvc_ingest_bytes_total${sel}[${RATE_INTERVAL}]))`,
    `sum by (pod) (kvc_store_used_bytes${sel})`,
    `sum(rate(kvc_compression_ratio_sum${sel}[${RATE_INTERVAL}])) / ` +
      `sum(rate(kvc_compression_ratio_count${sel}[${RATE_INTERVAL}]))`,
    `sum by (grpc_code) (rate(grpc_server_handled_total${sel}[${RATE_INTERVAL}])) > 0`,
  ];
  // The graphs end now (the page's end time has minute resolution) and start before the load.
  const range = `${Math.ceil(Date.now() / 1000 - from + 10)}s`;
  const q = new URLSearchParams();
  graphs.forEach((g, i) => {
    q.append(`g${i}.expr`, g);
    q.append(`g${i}.tab`, '0');
    q.append(`g${i}.stacked`, '0');
    q.append(`g${i}.range_input`, range);
  });
  const url = `${prom}/graph?${q}`;
  const out = path.resolve(args.screenshot);
  const run = spawnSync(
    args.chromium,
    [
      '--headless',
      '--no-sandbox',
      '--disable-gpu',
      '--hide-scrollbars',
      `--user-data-dir=${path.join(work, 'chromium')}`,
      '--window-size=1280,2900',
      '--virtual-time-budget=15000',
      `--screenshot=${out}`,
      url,
    ],
    { encoding: 'utf8', timeout: 120000 },
  );
  if (run.status !== 0 || !fs.existsSync(out)) {
    lib.fail(`chromium did not write ${out} (${run.status}):\n${run.stderr}`);
  }
  console.log(`ok: screenshot ${out} of ${url}`);
}

main()
  .then((code) => {
    cleanup();
    process.exit(code);
  })
  .catch((e) => {
    for (const c of children) {
      if (c.name !== 'kvcctl bench') console.log(`--- ${c.name}:\n${c.output().slice(-2000)}`);
    }
    cleanup();
    lib.fail(e.message);
  });
