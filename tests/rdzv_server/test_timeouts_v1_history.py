"""A version 1 snapshot (history events as ``[time, kind, text]``) shows in the status API the
facts its sentences state without doubt (``state_image._V1Facts``). Named ``test_timeouts_*`` only
to keep clear of files other work adds at the same time."""

from __future__ import annotations

import copy
import json
from typing import Any

from rdzv_server import state_image
from rdzv_server.machine.history import Departure, EventKind

from .test_history import DATA, eventful, facts, view


def v1_data() -> dict[str, Any]:
    data = json.loads((DATA / "snapshot_v1.json").read_text())
    assert data["version"] == 1 and len(data["jobs"][0]["history"][0]) == 3
    return data


def test_a_version_1_snapshot_shows_what_the_same_story_shows_today() -> None:
    # snapshot_v1.json ran eventful()'s story on the server before typed history. Before the
    # recovery its departed node3 was not listed, its failure had no round, and no round a number.
    h = eventful()
    old = view(state_image.load(v1_data()), h.now)
    assert facts(old) == facts(view(h.machine, h.now))
    assert facts(old)["members"] == [
        ("node3", "departed", "lost", "10.0.0.3", 2, None, old["rounds"][1]["ended_at"])
    ]
    history = {e["kind"]: e for e in old["history"]}
    assert (history["left"]["node"], history["left"]["departure"]) == ("node4", "left")
    assert (history["lost"]["node"], history["lost"]["departure"]) == ("node3", None)  # why: not told
    assert [e["round"] for e in old["history"] if e["kind"] == "round"] == [0, 1, 2, 3]


def test_a_sentence_that_does_not_say_for_sure_leaves_the_fields_empty() -> None:
    data = v1_data()
    events = data["jobs"][0]["history"]
    t = events[1][0]
    events[1:1] = [
        [t, "joined", "node a (b (10.0.0.9, nproc 2) joined (1 of 2:3)"],  # id or address holds " ("
        [t, "joined", "node c (10.0.0.8, nproc 99999999999999999999"],  # cut short: no ") joined ("
        [t, "lost", "node zz connection closed (2 remain)"],  # not a known id
        [t, "round", "round x" + "9" * 400],
        [t, "joined", "node " + "(" * 500],
    ]
    job = state_image.load(copy.deepcopy(data)).jobs["job"]
    odd = list(job.history)[1:6]
    assert [(e.node, e.addr, e.nproc, e.round, e.departure) for e in odd] == [("", "", None, None, None)] * 5
    # The rest still recovered, and the history is written back in the typed format.
    assert [(e.kind, e.node, e.departure) for e in job.history if e.kind is EventKind.LEFT] == [
        (EventKind.LEFT, "node4", Departure.LEFT)
    ]
    assert state_image.dump(state_image.load(data))["version"] == 2
