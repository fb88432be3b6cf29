"""The memory evaluation dataset: its file format (load, validate, save) and a generator of long conversations.

Format documented in docs/memory.md; generated sets plant facts, later updates, distractors and questions with evidence ids.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from moorage.memory.errors import DatasetError

FORMAT = "moorage-memory-eval/1"
QUESTION_TYPES = ("current", "history", "multi_session")


@dataclass(frozen=True)
class Turn:
    id: str
    ts: str  # ISO-8601, UTC
    speaker: str  # "user" | "assistant"
    text: str


@dataclass(frozen=True)
class SessionLog:
    id: str
    started_at: str
    turns: list[Turn]


@dataclass(frozen=True)
class Question:
    id: str
    type: str  # one of QUESTION_TYPES
    question: str
    answer: str
    evidence: list[str]  # ids of the turns that hold the answer
    asked_at: str


@dataclass(frozen=True)
class Conversation:
    id: str
    user: str
    sessions: list[SessionLog]
    questions: list[Question]

    def turns(self) -> list[Turn]:
        return [t for s in self.sessions for t in s.turns]


@dataclass(frozen=True)
class Dataset:
    name: str
    conversations: list[Conversation]
    seed: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "name": self.name, "seed": self.seed, "meta": self.meta,
                "conversations": [asdict(c) for c in self.conversations]}

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1, ensure_ascii=False) + "\n")


def parse_ts(value: str, where: str) -> float:
    try:
        dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except (TypeError, ValueError) as e:
        raise DatasetError(f"{where}: {value!r} is not an ISO-8601 timestamp", hint="write e.g. 2024-03-01T09:30:00Z") from e
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def load(path: Path) -> Dataset:
    """Read and validate a dataset file; every problem names where it is."""
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError as e:
        raise DatasetError(f"dataset file {path} does not exist", hint="generate one: moorage memory eval generate --out FILE") from e
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise DatasetError(f"{path} is not a {FORMAT} file", hint="see docs/memory.md for the format")
    try:
        convs = []
        for c in doc["conversations"]:
            sessions = [SessionLog(s["id"], s["started_at"], [Turn(t["id"], t["ts"], t["speaker"], t["text"]) for t in s["turns"]])
                        for s in c["sessions"]]
            questions = [Question(q["id"], q["type"], q["question"], q.get("answer", ""), list(q["evidence"]), q["asked_at"])
                         for q in c["questions"]]
            convs.append(Conversation(c["id"], c["user"], sessions, questions))
    except (KeyError, TypeError) as e:
        raise DatasetError(f"{path}: missing or malformed field {e}", hint="see docs/memory.md for the format") from e
    ds = Dataset(doc.get("name", Path(path).stem), convs, doc.get("seed"), doc.get("meta") or {})
    validate(ds)
    return ds


def validate(ds: Dataset) -> None:
    seen_conv: set[str] = set()
    for c in ds.conversations:
        if c.id in seen_conv:
            raise DatasetError(f"duplicate conversation id {c.id!r}")
        seen_conv.add(c.id)
        ids: dict[str, float] = {}
        for s in c.sessions:
            for t in s.turns:
                if t.id in ids:
                    raise DatasetError(f"conversation {c.id}: duplicate turn id {t.id!r}")
                ids[t.id] = parse_ts(t.ts, f"turn {t.id}")
        for q in c.questions:
            if q.type not in QUESTION_TYPES:
                raise DatasetError(f"question {q.id}: unknown type {q.type!r}", hint=f"one of {', '.join(QUESTION_TYPES)}")
            if not q.evidence:
                raise DatasetError(f"question {q.id} has no evidence turn ids")
            asked = parse_ts(q.asked_at, f"question {q.id}")
            for e in q.evidence:
                if e not in ids:
                    raise DatasetError(f"question {q.id}: evidence {e!r} is not a turn of conversation {c.id}")
                if ids[e] > asked:
                    raise DatasetError(f"question {q.id}: evidence {e!r} comes after the question was asked")


# -- the generator ----------------------------------------------------------------------------

# Each attribute: values, ways to state a first value, ways to state a change, and questions. Statements
# and questions deliberately share few words for some attributes (dense retrieval needed) and many for
# others (lexical retrieval needed), as real conversations do.
_ATTRS: list[dict[str, Any]] = [
    {"name": "city", "values": ["Lisbon", "Porto", "Valencia", "Leipzig", "Utrecht", "Gdansk", "Tallinn", "Bergen", "Ghent", "Bologna"],
     "state": ["I live in {v} these days.", "Our flat in {v} is tiny but I love the neighbourhood.", "Home for me is {v} right now."],
     "change": ["Big news: we packed everything and relocated to {v}.", "We finished the move, my new address is in {v}.", "Since the move I wake up in {v} every day."],
     "q_current": ["Which city am I based in now?", "Where is home for me at the moment?", "Which city do I live in now?"],
     "q_history": ["Where was I living before I moved to {new}?"],
     "q_multi": ["Which cities have I lived in so far?"],
     "near": ["My sister lives in {o} and loves it.", "A colleague just got back from a conference in {o}."]},
    {"name": "pet", "values": ["Biscuit", "Pepper", "Mochi", "Ziggy", "Nala", "Otto", "Pickles", "Juniper", "Waffles", "Luna"],
     "state": ["We adopted a puppy from the shelter and named him {v}.", "Our rescue dog {v} chewed my slippers again."],
     "change": ["Sadly we rehomed the puppy; the new kitten is called {v}.", "Meet {v}, the cat who now rules our house."],
     "q_current": ["What is the name of my pet?", "What do I call the animal that lives with me?", "What is my pet called these days?"],
     "q_history": ["What was the name of my dog before the cat {new}?"],
     "q_multi": ["Name every pet I have had."],
     "near": ["The neighbour's parrot is called {o}.", "My friend's hamster {o} escaped again."]},
    {"name": "employer", "values": ["Initech", "Hooli", "Globex", "Vandelay Industries", "Stark Logistics", "Wayne Analytics", "Umbrella Health", "Soylent Foods"],
     "state": ["I started a new job at {v}, the onboarding is intense.", "My team at {v} ships on Fridays."],
     "change": ["I handed in my notice and joined {v} on Monday.", "First week at {v} done, much nicer colleagues."],
     "q_current": ["Which company do I work for?", "Who is my current employer?", "Where is my job now?"],
     "q_history": ["Where did I work before joining {new}?"],
     "q_multi": ["List all the companies I have worked at."],
     "near": ["My brother got an offer from {o} but turned it down.", "I read that {o} is hiring again."]},
    {"name": "car", "values": ["Skoda Octavia", "Toyota Yaris", "Volvo V60", "Renault Zoe", "Mazda MX-5", "Fiat Panda", "Kia Niro", "VW Golf"],
     "state": ["I drive a {v}, it is old but reliable.", "The {v} needs new tyres before winter."],
     "change": ["Traded in the old car; picked up a {v} yesterday.", "The dealer finally delivered my {v}."],
     "q_current": ["What vehicle do I have now?", "Which car am I driving these days?", "What car do I drive now?"],
     "q_history": ["What did I drive before the {new}?"],
     "q_multi": ["Which cars have I owned?"],
     "near": ["My uncle swears by his {o}.", "A {o} blocked our driveway this morning."]},
    {"name": "coffee", "values": ["flat white", "oat cortado", "double espresso", "iced latte", "cappuccino", "long black"],
     "state": ["My usual order at the café is a {v}.", "Nothing beats a {v} before a long meeting."],
     "change": ["I switched my morning drink to a {v}.", "These days I only order a {v}."],
     "q_current": ["What do I usually get at the coffee shop?", "What is my go-to caffeine drink?", "What is my usual coffee order now?"],
     "q_history": ["What did I drink in the mornings before the {new}?"],
     "q_multi": ["What coffee orders have I had over time?"],
     "near": ["My manager always orders a {o}.", "The barista recommended a {o} but I passed."]},
    {"name": "hobby", "values": ["pottery", "bouldering", "salsa", "chess", "rowing", "ukulele", "birdwatching", "fencing"],
     "state": ["On Tuesday evenings I go to {v} class.", "I have been really into {v} lately, twice a week."],
     "change": ["I dropped the old class and signed up for {v} instead.", "My new weekly thing is {v}, the instructor is great."],
     "q_current": ["What activity do I do each week?", "Which class am I taking at the moment?", "What is my weekly class now?"],
     "q_history": ["What class did I take before I started {new}?"],
     "q_multi": ["Which hobbies have I picked up over time?"],
     "near": ["My cousin is obsessed with {o}.", "There is a {o} club near the office."]},
    {"name": "dentist", "values": ["Dr. Okafor", "Dr. Lindqvist", "Dr. Moreau", "Dr. Tanaka", "Dr. Alvarez", "Dr. Novak"],
     "state": ["My dentist is {v}, very gentle.", "Booked a cleaning with {v} for next month."],
     "change": ["I switched dentists, {v} is closer to work.", "From now on my teeth are in the hands of {v}."],
     "q_current": ["Who is my dentist?", "Which dentist do I see?"],
     "q_history": ["Which dentist did I see before {new}?"],
     "q_multi": ["Which dentists have I been to?"],
     "near": ["{o} treated my mother last year.", "A friend recommended {o} for braces."]},
]

_FILLER_OPENERS = [
    "Quick one:", "By the way,", "Random thought:", "Not urgent, but", "Today", "This morning", "Yesterday evening",
    "Honestly,", "Ugh,", "Fun fact:", "Reminder for later:", "So",
]
_FILLER_BODIES = [
    "the weather has been grey all week", "I watched a documentary about deep sea fish", "can you suggest a quick pasta recipe",
    "remind me to call the bank tomorrow", "I need a birthday present for a friend", "the train was late again",
    "what is a good book for a long flight", "I am trying to drink more water", "our team meeting ran over by an hour",
    "I finally fixed the squeaky door", "any tips for sleeping better", "I spent the weekend cleaning the garage",
    "how do I convert grams to ounces", "the supermarket was out of bread", "I might take a few days off in spring",
    "my laptop battery drains so fast", "help me write a polite email declining an invitation", "I planted basil on the balcony",
    "what should I cook for six people", "the internet was down for two hours", "I keep forgetting my umbrella",
    "the printer jammed twice", "I want to learn some basic Spanish", "my phone screen cracked", "the heating is making noises",
    "I ran five kilometres without stopping", "I need to renew my passport", "the neighbours had a loud party",
    "I am thinking about a standing desk", "my plants are not doing well", "I found a great podcast about history",
    "we ordered pizza again", "the dishwasher is leaking", "I should back up my photos",
]
_REPLY_OPENERS = ["Got it.", "Sounds good.", "Noted.", "Sure.", "Makes sense.", "Thanks for telling me.", "Okay.", "Understood."]
_REPLY_BODIES = [
    "Anything else?", "I will keep that in mind.", "Want me to set a reminder?", "Here is a short suggestion: keep it simple.",
    "Let me know how it goes.", "I can look into it later.", "That sounds like a plan.", "Shall I add it to your notes?",
]


def _iso(dt: datetime) -> str:
    return dt.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def generate(seed: int = 7, conversations: int = 6, sessions: int = 10, turns_per_session: int = 24,
             name: str | None = None) -> Dataset:
    """A deterministic dataset: same arguments, same file (byte for byte once saved)."""
    rng = random.Random(seed)
    convs = [_conversation(rng, n, sessions, turns_per_session) for n in range(conversations)]
    return Dataset(name or f"generated-seed{seed}", convs, seed,
                   {"generator": "moorage.memory.evalset", "sessions": sessions, "turns_per_session": turns_per_session})


def _conversation(rng: random.Random, n: int, n_sessions: int, per_session: int) -> Conversation:
    cid = f"c{n + 1}"
    start = datetime(2024, 1, 8, 9, 0, tzinfo=timezone.utc) + timedelta(days=rng.randint(0, 60))
    attrs = rng.sample(_ATTRS, k=min(len(_ATTRS), 5))
    # Plan: each attribute gets 1-3 values, stated in increasing session order.
    plan: list[tuple[int, dict[str, Any], list[str]]] = []
    for a in attrs:
        k = min(rng.choice([1, 2, 2, 3]), n_sessions)
        values = rng.sample(a["values"], k)
        sess = sorted(rng.sample(range(n_sessions), k))
        for i, (v, s) in enumerate(zip(values, sess)):
            plan.append((s, a, [v, "state" if i == 0 else "change"]))
    sessions: list[SessionLog] = []
    statements: dict[str, list[tuple[str, str]]] = {a["name"]: [] for a in attrs}  # attr -> [(value, turn id)]
    t_counter = 0
    day = start
    for s in range(n_sessions):
        day = day + timedelta(days=rng.randint(2, 9), minutes=rng.randint(0, 300))
        sid = f"{cid}-s{s + 1}"
        planted = [(a, v, how) for (ps, a, (v, how)) in plan if ps == s]
        slots = sorted(rng.sample(range(0, per_session, 2), k=min(len(planted), per_session // 2)))
        turns: list[Turn] = []
        clock = day
        for i in range(per_session):
            clock = clock + timedelta(seconds=rng.randint(20, 240))
            t_counter += 1
            tid = f"{cid}-t{t_counter}"
            if i % 2 == 1:
                turns.append(Turn(tid, _iso(clock), "assistant", f"{rng.choice(_REPLY_OPENERS)} {rng.choice(_REPLY_BODIES)}"))
                continue
            if i in slots and planted:
                a, v, how = planted.pop(0)
                text = rng.choice(a[how]).format(v=v)
                statements[a["name"]].append((v, tid))
            elif rng.random() < 0.08:
                a = rng.choice(attrs)
                others = [x for x in a["values"] if x not in {v for v, _ in statements[a["name"]]}]
                text = rng.choice(a["near"]).format(o=rng.choice(others))
            else:
                text = f"{rng.choice(_FILLER_OPENERS)} {rng.choice(_FILLER_BODIES)}."
            turns.append(Turn(tid, _iso(clock), "user", text))
        sessions.append(SessionLog(sid, _iso(day), turns))
    asked = _iso(day + timedelta(days=1))
    questions: list[Question] = []
    for a in attrs:
        said = statements[a["name"]]
        if not said:
            continue
        qn = len(questions)
        cur_v, cur_t = said[-1]
        questions.append(Question(f"{cid}-q{qn + 1}", "current", rng.choice(a["q_current"]), cur_v, [cur_t], asked))
        if len(said) >= 2:
            (old_v, old_t), (new_v, _) = said[-2], said[-1]
            questions.append(Question(f"{cid}-q{qn + 2}", "history", rng.choice(a["q_history"]).format(new=new_v), old_v, [old_t], asked))
            questions.append(Question(f"{cid}-q{qn + 3}", "multi_session", rng.choice(a["q_multi"]),
                                      ", ".join(v for v, _ in said), [t for _, t in said], asked))
    return Conversation(cid, f"user{n + 1}", sessions, questions)
