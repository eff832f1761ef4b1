// Type-checks Grafana dashboard JSON against Grafana's own TypeScript types (@grafana/schema,
// pinned in package.json) with `tsc --strict`: each file becomes an object literal typed as
// Dashboard, so a wrong type, a missing required field or an unknown field (a typo Grafana would
// silently ignore) is an error, reported at its line in the JSON file.
// Usage: node check_dashboard_types.cjs --modules=DIR FILE...
'use strict';
const fs = require('fs');
const path = require('path');
const { spawnSync } = require('child_process');
const lib = require('./lib.cjs');

const files = process.argv.slice(2).filter((a) => !a.startsWith('--'));
const args = lib.parseArgs(process.argv.slice(2).filter((a) => a.startsWith('--')));
if (!files.length) lib.fail('usage: check_dashboard_types.cjs --modules=DIR FILE...');
const req = lib.modulesRequire(args.modules);
const tsc = path.join(path.dirname(req.resolve('typescript')), 'tsc.js');
const schemaVersion = req('@grafana/schema/package.json').version;

// Inside the modules directory, so that '@grafana/schema' resolves from its node_modules.
const work = fs.mkdtempSync(path.join(path.resolve(args.modules), 'dashboard-types-'));
const sources = new Map();
files.forEach((file, i) => {
  let text = fs.readFileSync(file, 'utf8');
  try {
    JSON.parse(text);
  } catch (e) {
    lib.fail(`${file}: not valid JSON: ${e.message}`);
  }
  // Line 1 imports the type, the JSON starts on line 2: TypeScript line N is JSON line N - 1.
  const ts = path.join(work, `dashboard${i}.ts`);
  fs.writeFileSync(
    ts,
    `import type { Dashboard } from '@grafana/schema';\n` +
      `export const dashboard: Dashboard = ${text.trimEnd()};\n`,
  );
  sources.set(ts, file);
});
const run = spawnSync(
  process.execPath,
  // --skipLibCheck: the dashboards are checked, not Grafana's own declarations (5x faster).
  [tsc, '--noEmit', '--strict', '--skipLibCheck', '--lib', 'es2020', '--target', 'es2020',
   '--moduleResolution', 'node', '--pretty', 'false', ...sources.keys()],
  { encoding: 'utf8', timeout: 120000 },
);
fs.rmSync(work, { recursive: true, force: true });
if (run.error) lib.fail(`tsc did not run: ${run.error.message}`);
const problems = [];
for (const line of `${run.stdout}${run.stderr}`.split('\n')) {
  const m = /^(.*?)\((\d+),(\d+)\): (.*)$/.exec(line);
  if (m && sources.has(path.resolve(m[1]))) {
    problems.push(`${sources.get(path.resolve(m[1]))}:${Number(m[2]) - 1}: ${m[4]}`);
  } else if (line.trim()) {
    problems.push(line);
  }
}
if (run.status !== 0 || problems.length) {
  for (const p of problems) console.log(`FAIL: ${p}`);
  if (!problems.length) console.log(`FAIL: tsc exited ${run.status}`);
  process.exit(1);
}
console.log(`ok: ${files.join(', ')}: type-checks as @grafana/schema ${schemaVersion} Dashboard`);
