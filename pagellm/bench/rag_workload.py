"""The rag workload: questions about long documents, each prompt one document then one question.

The documents are generated text (seeded sentences over a fixed word list), the same on every machine
for one tokenizer; a prompt is the chat template's head, the document, the question and the template's
tail, joined as token ids, so that every prompt about one document starts with the same tokens (the
prefix the KV cache and its disk tier keep).
"""

from __future__ import annotations

import random
from typing import Any

from pagellm.bench.workloads import Workload

# Plain English words: documents read as text (a real tokenizer spends about one token per word).
_WORD_TEXT = (
    "the a of and to in is was for on with as by at from that this which it its their an be are were has "
    "had have not but or all each other one two three four five many few more most some any first last new "
    "old long short high low large small early late city river valley harbour bridge road market school "
    "library museum garden station factory mill farm forest lake island coast mountain village council "
    "report survey record account letter ledger archive map plan study budget census treaty charter "
    "merchant farmer builder teacher doctor sailor miner weaver baker clerk mayor engineer painter writer "
    "built opened closed moved grew fell rose changed carried traded measured counted wrote kept sold "
    "bought repaired crossed flooded dried planted harvested elected founded named described recorded "
    "north south east west winter summer spring autumn year month week morning evening century decade "
    "stone timber iron copper wool grain salt coal glass paper cloth rope water wind rain snow light "
    "because after before during while until since although when where however therefore also still"
)
WORDS = _WORD_TEXT.split()
TOPICS = ("harbour", "bridge", "market", "library", "mill", "census", "treaty", "council", "river", "school",
          "forest", "railway", "lighthouse", "granary", "canal", "quarry")
QUESTIONS = (
    "What does the document say about the {topic}?",
    "In one sentence, who is mentioned first in the document?",
    "Which season does the document mention most often?",
    "Summarise the document in one short sentence.",
    "What material is named in the document's first paragraph?",
    "Does the document mention a year or a decade? Answer briefly.",
    "What happened to the {topic}, according to the document?",
)
PREAMBLE = "Read the document below, then answer the question after it in one short sentence.\n\n"


def _document_text(rng: random.Random, index: int, words: int) -> str:
    topic = TOPICS[index % len(TOPICS)]
    sentences = [f"Document {index + 1}: an account of the {topic}."]
    count = 0
    while count < words:
        n = rng.randint(8, 18)
        body = " ".join(rng.choice(WORDS) for _ in range(n))
        if rng.random() < 0.3:
            body += f" near the {topic}"
        sentences.append(body[0].upper() + body[1:] + ".")
        count += n
        if rng.random() < 0.12:
            sentences[-1] += "\n\n"
    return " ".join(sentences)


def _template_parts(tokenizer: Any) -> tuple[str, str]:
    """The chat template's text before and after a user message (plain text without a template)."""
    mark = "\x00MESSAGE\x00"
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], add_generation_prompt=True,
                                             tokenize=False)
        if text.count(mark) == 1:
            head, tail = text.split(mark)
            return head, tail
    return "", "\nAnswer:"


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def rag_workload(tokenizer: Any, num_requests: int = 50, num_docs: int = 10, doc_range: tuple[int, int] = (2000, 4000),
                 answer_len: int = 16, seed: int = 0) -> Workload:
    """``num_requests`` questions about ``num_docs`` documents of ``doc_range`` tokens (inclusive, drawn
    uniformly); requests take the documents in turn, then are shuffled (seeded); ``answer_len`` tokens
    at most per answer. ``meta["doc_of"]``: each request's document; ``meta["doc_tokens"]``: each
    document's length in tokens."""
    if num_docs < 1 or num_requests < 1:
        raise ValueError(f"the rag workload needs >= 1 document and >= 1 request, got {num_docs} and {num_requests}")
    if not 1 <= doc_range[0] <= doc_range[1]:
        raise ValueError(f"document lengths MIN MAX need 1 <= MIN <= MAX, got {doc_range[0]} {doc_range[1]}")
    rng = random.Random(seed)
    head, tail = _template_parts(tokenizer)
    head_ids = _encode(tokenizer, head + PREAMBLE)
    docs: list[list[int]] = []
    for d in range(num_docs):
        target = rng.randint(*doc_range)
        ids: list[int] = []
        words = target
        while len(ids) < target:  # (a tokenizer that packs words tightly needs more of them)
            ids = _encode(tokenizer, _document_text(random.Random(f"{seed}-{d}"), d, words))
            words *= 2
        docs.append(ids[:target])
    doc_of = [i % num_docs for i in range(num_requests)]
    rng.shuffle(doc_of)
    prompts = []
    asked = [0] * num_docs
    for d in doc_of:  # (the k-th question about a document: the k-th of the list after its own start)
        question = QUESTIONS[(asked[d] + d) % len(QUESTIONS)].format(topic=TOPICS[d % len(TOPICS)])
        asked[d] += 1
        prompts.append(head_ids + docs[d] + _encode(tokenizer, "\n\nQuestion: " + question + tail))
    return Workload("rag", prompts, [answer_len] * num_requests,
                    meta={"num_docs": num_docs, "doc_range": list(doc_range), "seed": seed, "doc_of": doc_of,
                          "doc_tokens": [len(d) for d in docs], "prefix_tokens": len(head_ids)})
