"""guarantees.md § "Bad input": 200 random malformed messages, sent by name, through a real worker.

A careless or hostile producer sends the ledgered tasks of ``fuzz_app`` by name with missing
arguments, wrong types, NaN, infinities, huge numbers and strings, deep nesting, lone
surrogates, unknown keyword arguments and malformed ``ledger_deadline`` headers, on the
embedded default (SQLite ledger, ``filesystem://`` broker, no servers). Afterwards:

- the worker is still consuming (a good task sent last completes);
- every message ended: its Celery result is final, and its ledger entry is settled, with a
  reason unless it completed (a delivery whose arguments cannot be keyed or stored ends
  ``failed`` under its task id, with the refusal as its reason);
- ``celery-ledger list`` (text and ``--json``), ``show`` (text and ``--json``) and Flower's
  Ledger pages render every entry.

The seed is ``CELERY_LEDGER_FUZZ_SEED`` (fixed by default, so CI reruns the same 200); every
assertion names it and the message, so a failure reproduces.
"""

from __future__ import annotations

import base64
import json
import os
import random
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from celery.app.amqp import task_message
from celery.utils import uuid
from click.testing import CliRunner
from test_ledger_page_browser import PASSWORD, USER
from test_ledger_page_browser import flower as start_flower

from celery_ledger.cli.main import main as ledger_main
from celery_ledger.harness.processes import ProcessGroup
from celery_ledger.ledger import EntryNotFound, LedgerStore
from helpers import business_key, key_of
from procs import TESTS, test_env, wait_for
from test_delivery import client_app

pytestmark = pytest.mark.processes

SEED = int(os.environ.get("CELERY_LEDGER_FUZZ_SEED", "30"))
MESSAGES = int(os.environ.get("CELERY_LEDGER_FUZZ_MESSAGES", "200"))
#: Every message must end within this (bounded; the worker runs them at -c 2).
END_TIMEOUT = 240.0
BIN = Path(sys.executable).parent


def nested(depth: int) -> Any:
    value: Any = "bottom"
    for _ in range(depth):
        value = [value]
    return value


#: Values no signature asks for: the malformed part of a message.
HOSTILE: list[tuple[str, Any]] = [
    ("nan", float("nan")),
    ("inf", float("inf")),
    ("-inf", float("-inf")),
    ("huge-int", 10**40),
    ("huge-float", 1e308),
    ("negative", -1),
    ("none", None),
    ("true", True),
    ("empty-list", []),
    ("dict", {"a": {"b": [1, 2, {"c": None}]}}),
    ("big-string", "x" * 300_000),
    ("deep", nested(210)),
    ("surrogate", "card-\ud800"),
    ("control", "a\x00b\x1bc\r\n"),
    ("unicode", "Pässwort \"'\\ \u202e"),
    ("bytes-like", "\udcff\udcfe"),
]

#: Malformed ``ledger_deadline`` headers (the ledger's own deadline header).
BAD_DEADLINES: list[tuple[str, Any]] = [
    ("abc", "abc"),
    ("nan", "nan"),
    ("inf", float("inf")),
    ("year-2286", 1e10),
    ("negative", -5),
    ("list", [1, 2]),
    ("past", "PAST"),
]

DROP = object()
#: Malformed message fields: (field, value); ``DROP`` leaves a header out.
SHAPES: list[tuple[str, Any]] = [
    ("args", "abc"),
    ("args", {"order_id": "x"}),
    ("args", 7),
    ("kwargs", ["a", 1]),
    ("kwargs", "text"),
    ("kwargs", 3.5),
    ("embed", "no-canvas"),
    ("embed", {"callbacks": "x", "chain": 5}),
    ("argsrepr", DROP),
    ("kwargsrepr", DROP),
    ("retries", DROP),
    ("retries", "many"),
    ("root_id", DROP),
    ("timelimit", "abc"),
    ("timelimit", [float("nan"), None]),
    ("expires", "tomorrow"),
    ("eta", "not-a-date"),
    ("group_index", "first"),
    ("ledger_key", float("nan")),
]

SIGNATURES = {
    "fuzz_app.charge": ["order_id", "amount", "card", "currency"],
    "fuzz_app.note": ["text", "times"],
    "fuzz_app.keyed": ["tag"],
}


@dataclass
class Message:
    n: int
    task: str
    args: list[Any]
    kwargs: dict[str, Any]
    headers: dict[str, Any] = field(default_factory=dict)
    what: list[str] = field(default_factory=list)
    task_id: str = ""
    shape: tuple[str, Any] | None = None

    def __str__(self) -> str:
        return f"message {self.n} ({self.task}: {', '.join(self.what) or 'valid'}, seed {SEED})"


def good_call(task: str, n: int) -> dict[str, Any]:
    if task == "fuzz_app.charge":
        return {"order_id": f"o-{SEED}-{n}", "amount": 12, "card": "4111111111111111"}
    if task == "fuzz_app.note":
        return {"text": f"note {n}", "times": 2}
    return {"tag": f"t-{SEED}-{n}"}


def make_message(rng: random.Random, n: int) -> Message:
    task = rng.choice(sorted(SIGNATURES))
    kwargs = good_call(task, n)
    msg = Message(n, task, [], kwargs)
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(["drop", "hostile", "hostile", "extra", "positional", "deadline"])
        names = list(msg.kwargs)
        if kind == "drop" and names:
            name = rng.choice(names)
            del msg.kwargs[name]
            msg.what.append(f"no {name}")
        elif kind == "hostile":
            name = rng.choice(SIGNATURES[task])
            label, value = rng.choice(HOSTILE)
            msg.kwargs[name] = value
            msg.what.append(f"{name}={label}")
        elif kind == "extra":
            label, value = rng.choice(HOSTILE)
            msg.kwargs[f"unknown_{n}"] = value
            msg.what.append(f"unknown={label}")
        elif kind == "positional":
            # the same argument twice, or too many positionals
            label, value = rng.choice(HOSTILE)
            msg.args = [value] * rng.randint(1, 6)
            msg.what.append(f"{len(msg.args)} positional {label}")
        else:
            label, value = rng.choice(BAD_DEADLINES)
            msg.headers["ledger_deadline"] = time.time() - 30 if value == "PAST" else value
            msg.what.append(f"deadline={label}")
    if rng.random() < 0.15:
        # the message's own fields (below what ``send_task`` lets through): args no list,
        # kwargs no mapping, the canvas no mapping, or a header Celery writes left out
        field_name, value = rng.choice(SHAPES)
        msg.shape = (field_name, value)
        msg.what.append(
            f"{field_name}={type(value).__name__}" if value is not DROP else f"no {field_name}"
        )
    return msg


def send_raw(client: Any, msg: Message, queue: str) -> Any:
    """Publish ``msg`` as Celery's protocol 2 does, with one of its fields malformed."""
    task_id = uuid()
    headers, properties, body, sent = client.amqp.create_task_message(
        task_id, msg.task, msg.args, msg.kwargs
    )
    args, kwargs, embed = body
    field_name, value = msg.shape
    if field_name == "args":
        body = (value, kwargs, embed)
    elif field_name == "kwargs":
        body = (args, value, embed)
    elif field_name == "embed":
        body = (args, kwargs, value)
    elif value is DROP:
        headers.pop(field_name, None)
    else:
        headers[field_name] = value
    headers.update(msg.headers)
    with client.producer_or_acquire() as producer:
        client.amqp.send_task_message(
            producer, msg.task, task_message(headers, properties, body, sent), queue=queue
        )
    return client.AsyncResult(task_id)


def business_entry(msg: Message) -> str | None:
    """The business key a message of a keyed task carries (None for a task-id key)."""
    if msg.task == "fuzz_app.charge":
        return business_key(msg.task, order_id=msg.kwargs.get("order_id"))
    if msg.task == "fuzz_app.keyed" and isinstance(msg.kwargs.get("tag"), str):
        return key_of(msg.task, msg.kwargs["tag"].lower())
    return None


def final(result: Any) -> bool:
    return result.state in ("SUCCESS", "FAILURE", "REVOKED", "REJECTED")


def settled_with_reason(store: LedgerStore, key: str) -> str | None:
    """None if the entry ended with a reason; else what is wrong with it."""
    entry = store.get_entry(key)
    if not entry.status.settled:
        return f"entry {key} is {entry.status.value}, not settled"
    if entry.status.value != "completed" and not (entry.reason or entry.error):
        return f"entry {key} ended {entry.status.value} with no reason"
    return None


def http_status(url: str) -> tuple[int, str]:
    request = urllib.request.Request(url)
    creds = f"{USER}:{PASSWORD}".encode()
    request.add_header("Authorization", "Basic " + base64.b64encode(creds).decode())
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")


def test_two_hundred_malformed_messages_end_in_the_ledger_and_the_worker_lives(
    tmp_path: Path,
) -> None:
    ledger_url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    env = test_env(tmp_path, broker=None, ledger_url=ledger_url)
    client = client_app(env)
    rng = random.Random(SEED)
    messages = [make_message(rng, n) for n in range(MESSAGES)]
    group = ProcessGroup(tmp_path, app="fuzz_app", env=env, cwd=TESTS, pythonpath=[TESTS])
    store = LedgerStore(ledger_url)
    with group:
        worker = group.worker(
            "w1", queue=env["TEST_QUEUE"], node=f"w1-{env['TEST_ID']}@%h", concurrency=2
        ).wait_ready(90)
        results = []
        for msg in messages:
            if msg.shape is not None:
                result = send_raw(client, msg, env["TEST_QUEUE"])
            else:
                result = client.send_task(
                    msg.task, args=msg.args, kwargs=msg.kwargs, headers=msg.headers or None
                )
            msg.task_id = result.id
            results.append(result)

        def all_final() -> bool:
            if worker.proc is not None and worker.proc.poll() is not None:
                raise AssertionError(f"the worker died (seed {SEED}):\n{worker.log_tail()}")
            return all(final(r) for r in results)

        try:
            wait_for(all_final, timeout=END_TIMEOUT, interval=1.0, what="every message to end")
        except Exception as exc:
            stuck = [
                f"{m}: {r.state}" for m, r in zip(messages, results, strict=True) if not final(r)
            ]
            raise AssertionError(f"{len(stuck)} message(s) did not end: {stuck[:10]}") from exc

        # The worker is still consuming: a good task sent after all of them completes.
        last = client.send_task("fuzz_app.note", kwargs={"text": "still here", "times": 1})
        assert last.get(timeout=60) == len("still here"), worker.log_tail()
        assert worker.proc is not None and worker.proc.poll() is None

        problems: list[str] = []
        keys: dict[str, Message] = {}
        for msg, result in zip(messages, results, strict=True):
            found = store.find_keys(msg.task_id, limit=2)
            if not found and result.state == "SUCCESS":
                # A message with the key of an earlier one and its arguments: it ended in that
                # entry (its stored result), which must hold what the message returned.
                shared = business_entry(msg)
                try:
                    entry = store.get_entry(shared) if shared else None
                except EntryNotFound:
                    entry = None
                if entry is None or entry.status.value != "completed":
                    problems.append(f"{msg}: succeeded, but no completed entry of its key")
                continue
            if not found:
                problems.append(
                    f"{msg}: no ledger entry; result {result.state} {result.result!r:.200}"
                )
                continue
            key = next(k for k in found if store.get_entry(k).task_id == msg.task_id)
            wrong = settled_with_reason(store, key)
            if wrong:
                problems.append(f"{msg}: {wrong}")
            keys[key] = msg
        assert not problems, "\n".join(problems[:20])
        assert len(keys) >= MESSAGES // 4, f"only {len(keys)} entries (seed {SEED})"

        # The CLI renders every entry: list (text, --json) as a real process, show in-process.
        cli_env = {**os.environ, **env, "PYTHONPATH": str(TESTS)}
        listed = subprocess.run(
            [str(BIN / "celery-ledger"), "--url", ledger_url, "list", "--limit", "1000", "--json"],
            env=cli_env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert listed.returncode == 0, listed.stderr
        rows = json.loads(listed.stdout)["entries"]
        assert set(keys) <= {row["key"] for row in rows}, "list --json misses entries"
        text = subprocess.run(
            [str(BIN / "celery-ledger"), "--url", ledger_url, "list", "--limit", "1000"],
            env=cli_env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert text.returncode == 0 and "Traceback" not in text.stderr, text.stderr
        runner = CliRunner()
        for key, msg in keys.items():
            for extra in ([], ["--json"]):
                shown = runner.invoke(ledger_main, ["--url", ledger_url, "show", *extra, key])
                assert shown.exit_code == 0, f"show {' '.join(extra)} of {msg}: {shown.output}"
                if extra:
                    json.loads(shown.stdout)

        # Flower's Ledger pages render every entry.
        port = start_flower(group, "flower")
        base = f"http://127.0.0.1:{port}"
        for page in ("/ledger", "/ledger/stuck", "/ledger/stuck?age=0"):
            status, body = http_status(base + page)
            assert status == 200, f"{page}: {status} {body[:300]}"
        for key, msg in keys.items():
            page = "/ledger/entry/" + urllib.parse.quote(key, safe="")
            status, body = http_status(base + page)
            assert status == 200, f"{page} for {msg}: {status} {body[:300]}"
            assert "4111111111111111" not in body, f"the card is shown for {msg}"
            status, _ = http_status(f"{base}/ledger/task/{msg.task_id}")
            assert status in (200, 302), f"task page for {msg}: {status}"
    store.dispose()


@pytest.mark.parametrize(
    ("field_name", "value", "words"),
    [
        ("timelimit", "abc", "timelimit header"),
        ("args", {"order_id": "x"}, "args are a dict"),
        ("eta", "not-a-date", "invalid ETA"),
    ],
)
def test_a_message_with_a_malformed_field_is_refused_and_the_worker_lives(
    tmp_path: Path, field_name: str, value: Any, words: str
) -> None:
    """A ``timelimit`` header of ``"abc"`` ended the worker's main process (Celery unpacks it in
    ``execute_using_pool``); every malformed field is refused in the parent instead, with an
    entry of its own and the failure as the task's result, and the next message runs."""
    ledger_url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    env = test_env(tmp_path, broker=None, ledger_url=ledger_url)
    client = client_app(env)
    store = LedgerStore(ledger_url)
    group = ProcessGroup(tmp_path, app="fuzz_app", env=env, cwd=TESTS, pythonpath=[TESTS])
    with group:
        worker = group.worker(
            "w1", queue=env["TEST_QUEUE"], node=f"w1-{env['TEST_ID']}@%h", concurrency=1
        ).wait_ready(90)
        msg = Message(0, "fuzz_app.note", [], {"text": "hi"}, shape=(field_name, value))
        result = send_raw(client, msg, env["TEST_QUEUE"])
        with pytest.raises(Exception, match="malformed") as info:
            result.get(timeout=60)
        assert type(info.value).__name__ == "MalformedMessage", repr(info.value)
        after = client.send_task("fuzz_app.note", kwargs={"text": "after", "times": 1})
        assert after.get(timeout=60) == len("after"), worker.log_tail()
        assert worker.proc is not None and worker.proc.poll() is None
    (key,) = store.find_keys(result.id)
    entry = store.get_entry(key)
    assert entry.status.value == "failed"
    assert words in (entry.reason or ""), entry.reason
    store.dispose()
