"""Documents of the side-by-side harness: retrieval tasks and natural-text continuation.

Every document is a dict with token ids, ready for the model:
    prompt          context + question, exactly as the model reads it
    question_start  index of the question's first token (prompt[:question_start] is the context)
    answer          the ids greedy decoding must produce right after the prompt (exact match)
    task, id, meta  for the reader and the CSV
A continuation document has `prompt` (the prefix), question_start = len(prompt) and
`continuation` (the next tokens of the same text) instead of an answer.

The answer ids are taken from the tokenization of prompt text + answer text, and the prompt's
ids are checked to be a prefix of it (likewise the context's ids of the prompt's), so "the model
writes the answer" and "greedy ids equal `answer`" are the same thing.

Filler and continuation text come from files on the machine (Debian's license texts by default;
see `text_sources`), so nothing is downloaded and nothing is committed.
"""

import glob
import os
import random
import re

LICENSE_DIR = "/usr/share/common-licenses"
RELNOTES_GLOB = "/usr/share/doc/git/RelNotes/*.txt"

# 200 short words for RULER-style keys (the needle's name).
KEY_WORDS = """
apple river stone cloud maple tiger silver garden candle rocket violin harbor meadow falcon
copper lantern orchid pepper marble shadow thunder velvet window anchor basket bottle bridge
castle cherry circle comet crystal desert dragon engine feather forest galaxy ginger glacier
hammer island jacket jungle kettle ladder lemon magnet mirror monkey needle ocean olive onion
oyster paddle parrot pencil pillow planet pocket puzzle rabbit radio rainbow ribbon saddle
salmon shovel spider spoon squirrel sugar summer tablet teapot ticket tomato tunnel turtle
umbrella valley wagon walnut whistle winter wizard yellow zebra acorn badger beacon blossom
button cactus canyon carrot cobalt cotton coyote dancer dolphin eagle ember falcon fossil
frost gadget goblin granite harvest helmet hornet iguana ivory jasmine kayak kiwi koala
lagoon lizard llama lotus mango meteor mitten nectar nutmeg orbit otter panda peanut pebble
pelican penguin pirate plum poodle prism quartz quiver raven reef saffron sapphire scarlet
seagull sherbet sparrow spruce star stork tulip tundra velcro vortex waffle willow yacht
""".split()


def text_sources(extra_globs=()):
    """The text files used for filler and continuation: Debian's license texts, then git's
    release notes where the git package installed them, then `extra_globs`."""
    files = sorted(f for f in glob.glob(os.path.join(LICENSE_DIR, "*")) if os.path.isfile(f)
                   and not os.path.islink(f))
    files += sorted(glob.glob(RELNOTES_GLOB))
    for g in extra_globs:
        files += sorted(glob.glob(g))
    if not files:
        raise FileNotFoundError(f"no text files under {LICENSE_DIR} (Debian: base-files)")
    return files


def filler_lines(files=None):
    """Prose lines (20-200 characters, mostly letters) of the license texts, in file order."""
    files = files or sorted(f for f in glob.glob(os.path.join(LICENSE_DIR, "*"))
                            if os.path.isfile(f) and not os.path.islink(f))
    lines = []
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            for raw in fh:
                line = " ".join(raw.split())
                letters = sum(c.isalpha() or c == " " for c in line)
                if 20 <= len(line) <= 200 and letters >= 0.85 * len(line):
                    lines.append(line)
    return lines


class Builder:
    """Tokenizes documents and checks the prefix property described in the module doc."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def ids(self, text):
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def make(self, task, name, context, question, answer_text, meta):
        ctx = self.ids(context)
        prompt = self.ids(context + question)
        full = self.ids(context + question + answer_text)
        if prompt[:len(ctx)] != ctx or full[:len(prompt)] != prompt:
            return None  # a token merges across the boundary: the caller draws again
        answer = full[len(prompt):]
        if not answer or len(ctx) < 1 or len(ctx) >= len(prompt):
            return None
        return {"task": task, "id": name, "prompt": prompt, "question_start": len(ctx),
                "answer": answer, "meta": meta}

    def make_turns(self, task, name, context, question, turns, meta):
        """A document whose answer is several turns: `turns` = [(text, checked)], e.g. the first
        answer, a follow-up question (not checked: it is the user's), the second answer. `check`
        marks the answer tokens greedy decoding must reproduce."""
        ctx = self.ids(context)
        prompt = self.ids(context + question)
        if prompt[:len(ctx)] != ctx or len(ctx) >= len(prompt):
            return None
        text, prev, check = context + question, prompt, []
        for part, checked in turns:
            text += part
            cur = self.ids(text)
            if cur[:len(prev)] != prev:
                return None
            check += [checked] * (len(cur) - len(prev))
            prev = cur
        return {"task": task, "id": name, "prompt": prompt, "question_start": len(ctx),
                "answer": prev[len(prompt):], "check": check, "meta": meta}


def _haystack(rng, lines, tok_len, n_tokens, needles):
    """Filler lines from a random start until about n_tokens, with each needle sentence put at
    a random line boundary (depths recorded). Returns (text, depths in [0, 1])."""
    start = rng.randrange(len(lines))
    body, total = [], 0
    i = start
    while total < n_tokens:
        line = lines[i % len(lines)]
        body.append(line)
        total += tok_len(line) + 1
        i += 1
    slots = sorted(rng.sample(range(1, len(body)), len(needles)))
    order = list(range(len(needles)))
    out, depths, k = [], [0.0] * len(needles), 0
    for j, line in enumerate(body):
        while k < len(slots) and slots[k] == j:
            out.append(needles[order[k]])
            depths[order[k]] = j / len(body)
            k += 1
        out.append(line)
    return "\n".join(out) + "\n", depths


def _key5(rng):
    return str(rng.randrange(10000, 100000))


def passkey_docs(builder, n, n_tokens, seed, lines):
    """One 5-digit key, stated twice in one sentence, hidden in filler; plain completion."""
    rng = random.Random(seed)
    docs = []
    while len(docs) < n:
        key = _key5(rng)
        needle = f"The pass key is {key}. Remember it. {key} is the pass key."
        ctx, depth = _haystack(rng, lines, lambda s: len(builder.ids(s)), n_tokens, [needle])
        d = builder.make("passkey", f"passkey-{seed}-{len(docs)}", ctx,
                         "What is the pass key? The pass key is", " " + key,
                         {"key": key, "depth": round(depth[0], 3)})
        if d:
            docs.append(d)
    return docs


def multikey_docs(builder, n, n_tokens, seed, lines, keys=4):
    """RULER-style multi-key needle: `keys` needles `The special magic number for WORD is
    NNNNN.`, one of them asked."""
    rng = random.Random(seed)
    docs = []
    while len(docs) < n:
        words = rng.sample(KEY_WORDS, keys)
        values = [_key5(rng) for _ in words]
        needles = [f"The special magic number for {w} is {v}." for w, v in zip(words, values)]
        ctx, depths = _haystack(rng, lines, lambda s: len(builder.ids(s)), n_tokens, needles)
        ask = rng.randrange(keys)
        d = builder.make("multikey", f"multikey-{seed}-{len(docs)}", ctx,
                         f"What is the special magic number for {words[ask]}? The special magic "
                         f"number for {words[ask]} is", " " + values[ask],
                         {"key": words[ask], "value": values[ask], "keys": keys,
                          "depth": round(depths[ask], 3)})
        if d:
            docs.append(d)
    return docs


def multivalue_docs(builder, n, n_tokens, seed, lines, values=3):
    """RULER-style multi-value needle: one word with `values` numbers in separate needles; all
    asked, answered in the order they appear in the text (`A, B and C`)."""
    rng = random.Random(seed)
    docs = []
    while len(docs) < n:
        word = rng.choice(KEY_WORDS)
        nums = [_key5(rng) for _ in range(values)]
        needles = [f"One of the special magic numbers for {word} is {v}." for v in nums]
        ctx, depths = _haystack(rng, lines, lambda s: len(builder.ids(s)), n_tokens, needles)
        in_order = [v for _, v in sorted(zip(depths, nums))]
        answer = " " + ", ".join(in_order[:-1]) + " and " + in_order[-1] + "."
        d = builder.make("multivalue", f"multivalue-{seed}-{len(docs)}", ctx,
                         f"What are all the special magic numbers for {word}? The special magic "
                         f"numbers for {word} are", answer,
                         {"key": word, "values": in_order, "depths": sorted(depths)})
        if d:
            docs.append(d)
    return docs


def multiquery_docs(builder, n, n_tokens, seed, lines, keys=4):
    """RULER-style multi-query: `keys` needles, two of them asked one after the other (the
    second question follows the model's first answer); both answers must be right."""
    rng = random.Random(seed)
    docs = []
    while len(docs) < n:
        words = rng.sample(KEY_WORDS, keys)
        values = [_key5(rng) for _ in words]
        needles = [f"The special magic number for {w} is {v}." for w, v in zip(words, values)]
        ctx, depths = _haystack(rng, lines, lambda s: len(builder.ids(s)), n_tokens, needles)
        a, c = rng.sample(range(keys), 2)
        q = (f"What is the special magic number for {words[a]}? The special magic number for "
             f"{words[a]} is")
        q2 = (f". What is the special magic number for {words[c]}? The special magic number "
              f"for {words[c]} is")
        d = builder.make_turns("multiquery", f"multiquery-{seed}-{len(docs)}", ctx, q,
                               [(" " + values[a], True), (q2, False), (" " + values[c], True)],
                               {"keys": [words[a], words[c]], "values": [values[a], values[c]],
                                "depths": [round(depths[a], 3), round(depths[c], 3)]})
        if d:
            docs.append(d)
    return docs


def vartrack_docs(builder, n, n_tokens, seed, lines, hops=2):
    """RULER-style variable tracking, one chain: `VAR A = 12345.` then `VAR B = VAR A.` ...
    (hops assignments, in order, at random depths); asked for the value of the last
    variable. The model must follow the chain through the context."""
    rng = random.Random(seed)
    docs = []
    while len(docs) < n:
        names = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(3))
                 for _ in range(hops + 1)]
        if len(set(names)) < len(names):
            continue
        value = _key5(rng)
        needles = [f"VAR {names[0]} = {value}."]
        needles += [f"VAR {names[i + 1]} = VAR {names[i]}." for i in range(hops)]
        ctx, depths = _haystack(rng, lines, lambda s: len(builder.ids(s)), n_tokens, needles)
        if sorted(depths) != depths:  # keep the chain in reading order
            continue
        d = builder.make("vartrack", f"vartrack-{seed}-{len(docs)}", ctx,
                         f"Question: VAR {names[-1]} holds which number? Answer: The number "
                         f"VAR {names[-1]} holds is", " " + value,
                         {"chain": names, "value": value, "depths": depths})
        if d:
            docs.append(d)
    return docs


# QA over the context: facts about people. The question names the relation in its own words; the
# answer starts by repeating the statement's verb phrase (SmolLM2-135M fails the task when the
# statement is worded differently too: docs/fidelity-smollm2.md).
NAMES = """
Alice Bruno Clara Daniel Elena Felix Greta Hugo Irene Jonas Karen Leo Maria Nadia Oscar Paula
Quentin Rosa Simon Tanya Victor Wanda Xavier Yvonne
""".split()
CITIES = """
Paris Berlin Madrid Lisbon Vienna Prague Dublin Oslo Warsaw Athens Rome Helsinki Budapest
Brussels Amsterdam Zurich Geneva Milan Munich Seville Naples Krakow Lyon Porto
""".split()
JOBS = "baker dentist farmer painter pilot plumber nurse teacher lawyer chef tailor banker".split()
INSTRUMENTS = "piano violin guitar flute trumpet drums cello harp clarinet saxophone".split()
MONTHS = ("January February March April May June July August September October November "
          "December").split()
# (relation, statement template, question, answer prefix the model continues, values)
RELATIONS = (
    ("city", "Since childhood {n} lives in {v}.", "In which city does {n} live?",
     "{n} lives in", CITIES),
    ("job", "For ten years now {n} works as a {v}.", "What is {n}'s job?",
     "{n} works as a", JOBS),
    ("instrument", "In the town band {n} plays the {v}.", "Which instrument does {n} play?",
     "{n} plays the", INSTRUMENTS),
    ("month", "As the family knows, {n} was born in {v}.", "In which month was {n} born?",
     "{n} was born in", MONTHS),
)


def qa_docs(builder, n, n_tokens, seed, lines, people=2, relations=2):
    """QA over the context: `people` people with `relations` facts each, every fact its own
    sentence at a random depth ("For ten years now Clara works as a pilot."); one fact asked
    ("What is Clara's job? Clara works as a"), answer one word. Every person has the same
    relations, so the answer needs the right person as well as the right relation."""
    rng = random.Random(seed)
    docs = []
    while len(docs) < n:
        names = rng.sample(NAMES, people)
        rels = rng.sample(RELATIONS, relations)
        facts, needles = [], []
        for name in names:
            for rel in rels:
                v = rng.choice(rel[4])
                facts.append((name, rel, v))
                needles.append(rel[1].format(n=name, v=v))
        ctx, depths = _haystack(rng, lines, lambda s: len(builder.ids(s)), n_tokens, needles)
        i = rng.randrange(len(facts))
        name, rel, v = facts[i]
        d = builder.make("qa", f"qa-{seed}-{len(docs)}", ctx,
                         f"{rel[2].format(n=name)} {rel[3].format(n=name)}",
                         " " + v, {"person": name, "relation": rel[0], "value": v,
                                   "facts": len(facts), "depth": round(depths[i], 3)})
        if d:
            docs.append(d)
    return docs


def continuation_docs(builder, n, prefix, cont, seed, files):
    """Non-overlapping windows of prefix + cont tokens of natural text (the files in order,
    whitespace runs normalised), n of them spread evenly over the stream."""
    text = []
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            text.append(re.sub(r"[ \t]+", " ", fh.read()))
    ids = builder.ids("\n\n".join(text))
    size = prefix + cont
    slots = len(ids) // size
    if slots < n:
        raise ValueError(f"continuation: the text gives {slots} windows of {size} tokens, "
                         f"{n} wanted (add text files)")
    rng = random.Random(seed)
    picks = sorted(rng.sample(range(slots), n))
    docs = []
    for i, s in enumerate(picks):
        w = ids[s * size:(s + 1) * size]
        docs.append({"task": "continuation", "id": f"continuation-{seed}-{i}", "prompt": w[:prefix],
                     "question_start": prefix, "continuation": w[prefix:],
                     "meta": {"offset": s * size}})
    return docs


def kvlist_docs(builder, n, n_tokens, seed, lines=None):
    """RULER-style multi-key with a haystack of needles only (niah_multikey_2): every line is
    `The special magic number for WORD is NNNNN.` with distinct words; one asked."""
    rng = random.Random(seed)
    docs = []
    while len(docs) < n:
        words, body, total = [], [], 0
        pool = rng.sample(KEY_WORDS, len(KEY_WORDS))
        while total < n_tokens and pool:
            w, v = pool.pop(), _key5(rng)
            line = f"The special magic number for {w} is {v}."
            words.append((w, v))
            body.append(line)
            total += len(builder.ids(line)) + 1
        i = rng.randrange(len(words))
        w, v = words[i]
        d = builder.make("kvlist", f"kvlist-{seed}-{len(docs)}", "\n".join(body) + "\n",
                         f"What is the special magic number for {w}? The special magic "
                         f"number for {w} is", " " + v,
                         {"key": w, "value": v, "keys": len(words),
                          "depth": round(i / len(words), 3)})
        if d:
            docs.append(d)
    return docs
