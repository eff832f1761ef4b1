// Helpers shared by the deploy checks: loading the pinned npm packages from the directory npm ci
// installed them into, YAML, kvcd byte sizes and flagfiles, Kubernetes quantities.
'use strict';
const fs = require('fs');
const path = require('path');
const { createRequire } = require('module');

// Returns a require() that resolves packages from MODULES_DIR/node_modules.
function modulesRequire(modulesDir) {
  if (!modulesDir || !fs.existsSync(path.join(modulesDir, 'node_modules'))) {
    fail(`no node_modules under '${modulesDir}': run tests/deploy/npm_ci.sh first`);
  }
  return createRequire(path.join(path.resolve(modulesDir), 'package.json'));
}

function fail(message) {
  console.error(`FAIL: ${message}`);
  process.exit(1);
}

// Parses "--name=value" options; bare "--name" is true.
function parseArgs(argv) {
  const args = {};
  for (const a of argv) {
    const m = /^--([a-z_-]+)(?:=(.*))?$/s.exec(a);
    if (!m) fail(`unexpected argument '${a}'`);
    args[m[1]] = m[2] === undefined ? true : m[2];
  }
  return args;
}

// kvcd's byte sizes: a number with an optional K/M/G/T suffix (powers of 1024), optionally
// followed by "i", "B" or "iB", as kvcd's --store_bytes etc. accept them.
function parseByteSize(text) {
  const m = /^\s*(\d+)\s*(?:([kmgt])(i?b?)|(b?))\s*$/i.exec(String(text));
  if (!m) return NaN;
  const shift = { k: 10, m: 20, g: 30, t: 40 }[(m[2] || '').toLowerCase()] || 0;
  return Number(m[1]) * 2 ** shift;
}

// Kubernetes resource quantities: binary (Ki..Ei), decimal (k..E), milli (m) and plain numbers.
function parseQuantity(q) {
  const m = /^([0-9.]+)(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?$/.exec(String(q));
  if (!m) return NaN;
  const mult =
    {
      Ki: 2 ** 10,
      Mi: 2 ** 20,
      Gi: 2 ** 30,
      Ti: 2 ** 40,
      Pi: 2 ** 50,
      Ei: 2 ** 60,
      m: 1e-3,
      k: 1e3,
      M: 1e6,
      G: 1e9,
      T: 1e12,
      P: 1e15,
      E: 1e18,
    }[m[2]] || 1;
  return Number(m[1]) * mult;
}

// An absl flagfile: one --name=value per line, '#' comments and blank lines ignored.
function parseFlagfile(text) {
  const flags = {};
  for (const raw of text.split('\n')) {
    const line = raw.trim();
    if (line === '' || line.startsWith('#')) continue;
    const m = /^--([A-Za-z0-9_]+)(?:=(.*))?$/.exec(line);
    if (!m) throw new Error(`flagfile line '${line}' is not --name=value`);
    flags[m[1]] = m[2] === undefined ? 'true' : m[2];
  }
  return flags;
}

function portOf(address) {
  const i = String(address).lastIndexOf(':');
  return i < 0 ? NaN : Number(address.slice(i + 1));
}

module.exports = {
  modulesRequire,
  fail,
  parseArgs,
  parseByteSize,
  parseQuantity,
  parseFlagfile,
  portOf,
};
