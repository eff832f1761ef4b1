// Structural checks of the Grafana dashboard: valid JSON, a fixed uid, schemaVersion, the
// datasource/namespace/pod variables, panels that use them, do not overlap, and together show
// what operators need (rates, errors, p50/p99, bytes, compression, store, evictions, rejections,
// GPU memory). Which metric names exist is check_kvcd.cjs' job.
// Usage: node check_dashboard.cjs FILE
'use strict';
const fs = require('fs');
const { selectors } = require('./promql.cjs');

const file = process.argv[2];
const problems = [];
const problem = (what) => problems.push(what);
let d;
try {
  d = JSON.parse(fs.readFileSync(file, 'utf8'));
} catch (e) {
  console.log(`FAIL: ${file}: not valid JSON: ${e.message}`);
  process.exit(1);
}

if (typeof d.uid !== 'string' || !/^[A-Za-z0-9_-]{1,40}$/.test(d.uid))
  problem(`uid '${d.uid}' is not a fixed id (1-40 of [A-Za-z0-9_-])`);
if (!d.title) problem('no title');
if (!Number.isInteger(d.schemaVersion) || d.schemaVersion < 36)
  problem(`schemaVersion ${d.schemaVersion} is not an integer >= 36`);

const vars = new Map(((d.templating && d.templating.list) || []).map((v) => [v.name, v]));
const ds = vars.get('datasource');
if (!ds || ds.type !== 'datasource' || ds.query !== 'prometheus')
  problem("no variable 'datasource' of type datasource, query prometheus");
const isOurDs = (x) =>
  x && x.type === 'prometheus' && ['${datasource}', '$datasource'].includes(x.uid);
for (const name of ['namespace', 'pod']) {
  const v = vars.get(name);
  if (!v || v.type !== 'query') {
    problem(`no query variable '${name}'`);
    continue;
  }
  if (!isOurDs(v.datasource)) problem(`variable '${name}' does not query \${datasource}`);
}
if (vars.get('pod') && !(vars.get('pod').multi && vars.get('pod').includeAll))
  problem("variable 'pod' should allow several pods and All");

const panels = (d.panels || []).flatMap((p) => [p, ...(p.panels || [])]);
const ids = new Set();
const boxes = [];
const metricsByPanel = [];
for (const p of panels) {
  const where = `panel ${p.id} '${p.title}'`;
  if (!Number.isInteger(p.id) || ids.has(p.id)) problem(`${where}: id missing or repeated`);
  ids.add(p.id);
  const g = p.gridPos || {};
  if (!(g.w > 0 && g.h > 0 && g.x >= 0 && g.y >= 0 && g.x + g.w <= 24))
    problem(`${where}: bad gridPos ${JSON.stringify(g)}`);
  for (const b of boxes) {
    if (g.x < b.x + b.w && b.x < g.x + g.w && g.y < b.y + b.h && b.y < g.y + g.h)
      problem(`${where}: overlaps panel ${b.id}`);
  }
  boxes.push({ ...g, id: p.id });
  if (p.type === 'row') continue;
  if (!p.title) problem(`${where}: no title`);
  if (!isOurDs(p.datasource)) problem(`${where}: datasource is not \${datasource}`);
  const targets = p.targets || [];
  if (!targets.length) problem(`${where}: no queries`);
  const refIds = new Set();
  const names = new Set();
  for (const t of targets) {
    if (!t.refId || refIds.has(t.refId)) problem(`${where}: refId missing or repeated`);
    refIds.add(t.refId);
    if (!t.expr) {
      problem(`${where}: query ${t.refId} has no expr`);
      continue;
    }
    let sels = [];
    try {
      sels = selectors(t.expr);
    } catch (e) {
      problem(`${where}: ${e.message}`);
    }
    for (const s of sels) {
      names.add(s.name);
      const has = (label, op, value) =>
        s.matchers.some((m) => m.label === label && m.op === op && m.value === value);
      if (!has('namespace', '=', '$namespace') || !has('pod', '=~', '$pod')) {
        problem(`${where}: ${s.name} is not scoped by namespace="$namespace", pod=~"$pod"`);
      }
    }
  }
  metricsByPanel.push({ where, p, names, exprs: targets.map((t) => t.expr || '').join('\n') });
}

// What the dashboard must show, each as a predicate over one panel.
const needs = [
  [
    'request rate',
    (x) =>
      x.names.has('grpc_server_handled_total') &&
      /rate\(/.test(x.exprs) &&
      !/grpc_code/.test(x.exprs),
  ],
  [
    'error ratio',
    (x) =>
      x.names.has('grpc_server_handled_total') &&
      /grpc_code\s*!=\s*"OK"/.test(x.exprs) &&
      x.exprs.includes('/'),
  ],
  [
    'p50 and p99 latency',
    (x) =>
      x.names.has('grpc_server_handling_seconds_bucket') &&
      /histogram_quantile\(0\.5,/.test(x.exprs) &&
      /histogram_quantile\(0\.99,/.test(x.exprs),
  ],
  [
    'bytes in and out',
    (x) => x.names.has('kvc_ingest_bytes_total') && x.names.has('kvc_served_bytes_total'),
  ],
  ['compression ratio', (x) => [...x.names].some((n) => n.startsWith('kvc_compression_ratio'))],
  [
    'store used vs capacity',
    (x) => x.names.has('kvc_store_used_bytes') && x.names.has('kvc_store_capacity_bytes'),
  ],
  ['evictions', (x) => x.names.has('kvc_evictions_total')],
  ['rejections', (x) => x.names.has('kvc_rejected_requests_total')],
  ['GPU memory', (x) => x.names.has('kvc_gpu_memory_used_bytes')],
];
for (const [what, pred] of needs) {
  if (!metricsByPanel.some(pred)) problem(`no panel shows ${what}`);
}

if (problems.length) {
  for (const p of problems) console.log(`FAIL: ${file}: ${p}`);
  process.exit(1);
}
console.log(
  `ok: ${file}: uid ${d.uid}, schemaVersion ${d.schemaVersion}, ${metricsByPanel.length} panels`,
);
