// A small PromQL scanner: finds every vector selector (metric name + label matchers) in an
// expression. It knows enough of the grammar to tell metric names from functions, aggregation
// operators, keywords, label lists (by/without/on/ignoring/group_*), ranges, durations, numbers,
// strings and Grafana variables; it does not evaluate anything.
'use strict';

const KEYWORDS = new Set([
  'and',
  'or',
  'unless',
  'bool',
  'offset',
  'atan2',
  'nan',
  'inf',
  'NaN',
  'Inf',
  'sum',
  'min',
  'max',
  'avg',
  'group',
  'stddev',
  'stdvar',
  'count',
  'count_values',
  'bottomk',
  'topk',
  'quantile',
  'limitk',
  'limit_ratio',
]);
const LABEL_LIST_KEYWORDS = new Set([
  'by',
  'without',
  'on',
  'ignoring',
  'group_left',
  'group_right',
]);

// Returns [{name, matchers: [{label, op, value}]}]; throws Error on text it cannot scan.
function selectors(expr) {
  const out = [];
  let i = 0;
  const n = expr.length;
  const skipSpace = () => {
    while (i < n && /\s/.test(expr[i])) i++;
  };
  const readString = () => {
    const q = expr[i++];
    let s = '';
    while (i < n && expr[i] !== q) {
      if (expr[i] === '\\' && q !== '`') {
        s += expr[i + 1];
        i += 2;
      } else s += expr[i++];
    }
    if (i >= n) throw new Error(`unterminated string in '${expr}'`);
    i++;
    return s;
  };
  const readMatchers = () => {
    // at '{'
    i++;
    const matchers = [];
    for (;;) {
      skipSpace();
      if (expr[i] === '}') {
        i++;
        return matchers;
      }
      const m = /^([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*/.exec(expr.slice(i));
      if (!m) throw new Error(`bad label matcher at '${expr.slice(i, i + 30)}'`);
      i += m[0].length;
      if (!'"\'`'.includes(expr[i])) throw new Error(`label ${m[1]}: value is not a string`);
      matchers.push({ label: m[1], op: m[2], value: readString() });
      skipSpace();
      if (expr[i] === ',') i++;
    }
  };
  while (i < n) {
    const ch = expr[i];
    if (/\s/.test(ch)) {
      i++;
      continue;
    }
    if ('"\'`'.includes(ch)) {
      readString();
      continue;
    }
    if (ch === '[') {
      // range or subquery: durations and Grafana variables only
      const end = expr.indexOf(']', i);
      if (end < 0) throw new Error(`unterminated '[' in '${expr}'`);
      i = end + 1;
      continue;
    }
    if (ch === '$') {
      // Grafana variable: $name or ${name}
      const m = /^\$(\{[^}]*\}|[A-Za-z0-9_]+)/.exec(expr.slice(i));
      i += m ? m[0].length : 1;
      continue;
    }
    if (/[0-9.]/.test(ch)) {
      // number or duration
      const m = /^[0-9.]+(e[+-]?[0-9]+)?([a-zA-Z]+)?/.exec(expr.slice(i));
      i += m[0].length;
      continue;
    }
    if (ch === '{') {
      const matchers = readMatchers();
      const name = matchers.find((m) => m.label === '__name__' && m.op === '=');
      if (!name) throw new Error(`selector without a metric name in '${expr}'`);
      out.push({ name: name.value, matchers: matchers.filter((m) => m !== name) });
      continue;
    }
    const id = /^[A-Za-z_:][A-Za-z0-9_:]*/.exec(expr.slice(i));
    if (!id) {
      i++;
      continue;
    } // operators, parentheses, commas
    const word = id[0];
    i += word.length;
    skipSpace();
    if (LABEL_LIST_KEYWORDS.has(word)) {
      if (expr[i] === '(') {
        const end = expr.indexOf(')', i);
        if (end < 0) throw new Error(`unterminated label list after '${word}'`);
        i = end + 1;
      }
      continue;
    }
    if (KEYWORDS.has(word) || expr[i] === '(') continue; // operator or function call
    out.push({ name: word, matchers: expr[i] === '{' ? readMatchers() : [] });
  }
  return out;
}

module.exports = { selectors };
