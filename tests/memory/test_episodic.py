"""Episodic memory on both store backends: hybrid retrieval, filters, embeddings on write, isolation."""

from __future__ import annotations

from moorage.memory.embeddings import Embedder
from moorage.memory.episodic import EpisodicMemory
from moorage.memory.ranking import FusionWeights
from moorage.store import EventIn, Scope, TenantStore

T0 = 1_700_000_000.0
ALICE = Scope.for_user("concierge", "alice")
BOB = Scope.for_user("concierge", "bob")

LOG = [
    ("user", "We finally adopted a kitten from the shelter, we named her Miso."),
    ("assistant", "Congratulations! Shelters are a great place to adopt."),
    ("user", "The quarterly report is due next Thursday."),
    ("user", "Traffic on the ring road was terrible this morning."),
    ("user", "I repainted the kitchen walls a pale yellow."),
    ("assistant", "Pale yellow makes a small kitchen feel bigger."),
    ("user", "My brother is visiting from Montreal in May."),
    ("user", "Remind me to renew the car insurance."),
]


def _fill(mem: EpisodicMemory, scope: Scope) -> list:
    return mem.remember_many(scope, [EventIn("message", text, speaker, None, T0 + 3600 * i) for i, (speaker, text) in enumerate(LOG)])


def test_hybrid_finds_paraphrased_evidence_that_bm25_misses(tenant: TenantStore, embedder: Embedder) -> None:
    mem = EpisodicMemory(tenant, embedder)
    events = _fill(mem, ALICE)
    query = "what is my cat called?"
    lexical = [e.id for e, _ in mem.search_lexical(ALICE, query)]
    assert events[0].id not in lexical  # no shared word: "cat"/"called" vs "kitten"/"named"
    hits = mem.search(ALICE, query, k=3)
    assert hits[0].event.id == events[0].id
    assert hits[0].dense_rank == 1 and hits[0].lexical_rank is None


def test_embeddings_are_written_with_the_events(tenant: TenantStore, embedder: Embedder) -> None:
    mem = EpisodicMemory(tenant, embedder)
    events = _fill(mem, ALICE)
    stored = tenant.events.embeddings(ALICE)
    assert [i for i, _ in stored] == [e.id for e in events]
    assert all(len(b) == embedder.dimension * 4 for _, b in stored)


def test_speaker_and_time_filters_apply_to_both_rankings(tenant: TenantStore, embedder: Embedder) -> None:
    mem = EpisodicMemory(tenant, embedder)
    events = _fill(mem, ALICE)
    only_assistant = mem.search(ALICE, "kitchen paint colour", k=5, speakers=["assistant"])
    assert only_assistant and all(h.event.speaker == "assistant" for h in only_assistant)
    assert only_assistant[0].event.id == events[5].id
    late = mem.search(ALICE, "kitten adoption", k=10, since=T0 + 3600 * 4)
    assert late and all(h.event.ts >= T0 + 3600 * 4 for h in late)
    assert events[0].id not in {h.event.id for h in late}


def test_new_events_are_seen_by_an_existing_memory_object(tenant: TenantStore, embedder: Embedder) -> None:
    mem = EpisodicMemory(tenant, embedder)
    _fill(mem, ALICE)
    assert mem.search(ALICE, "dentist appointment", k=1)[0].event.content != "The dentist moved my appointment to Friday."
    ev = mem.remember(ALICE, "message", "The dentist moved my appointment to Friday.", speaker="user", ts=T0 + 86400)
    assert mem.search(ALICE, "when is the dentist?", k=1)[0].event.id == ev.id


def test_backfill_embeds_events_appended_straight_to_the_store(tenant: TenantStore, embedder: Embedder) -> None:
    mem = EpisodicMemory(tenant, embedder, lazy_embed=0)  # searches leave missing vectors to backfill
    ev = tenant.events.append(ALICE, "message", "Our kitten Miso chewed the charger cable.", speaker="user", ts=T0)
    assert mem.search_dense(ALICE, "cat damage") == []
    assert mem.backfill(ALICE) == 1
    assert mem.search_dense(ALICE, "cat damage")[0][0] == ev.id


def test_events_written_for_later_embedding_are_found_at_once_and_by_meaning_once_embedded(
        tenant: TenantStore, embedder: Embedder) -> None:
    mem = EpisodicMemory(tenant, embedder, lazy_embed=0)
    _fill(mem, ALICE)
    (ev,) = mem.remember_pending(ALICE, [EventIn("message", "Our kitten Miso chewed the charger cable.", "user")])
    assert [e.id for e in tenant.events.unembedded()] == [ev.id]
    # Full text finds it before it has a vector; the cosine ranking does not know it yet.
    assert mem.search(ALICE, "charger cable", k=1)[0].event.id == ev.id
    assert ev.id not in {i for i, _ in mem.search_dense(ALICE, "cat damage")}
    # Embedded by someone else (the background queue, another host): the cached scope picks the vector up.
    assert EpisodicMemory(tenant, embedder).embed_pending() == 1
    assert tenant.events.unembedded() == []
    assert mem.search_dense(ALICE, "cat damage")[0][0] == ev.id
    hit = mem.search(ALICE, "what did the cat break?", k=1)[0]
    assert hit.event.id == ev.id and hit.dense_rank is not None


def test_a_search_embeds_the_newest_events_still_without_a_vector(tenant: TenantStore, embedder: Embedder) -> None:
    mem = EpisodicMemory(tenant, embedder, lazy_embed=2)
    evs = mem.remember_pending(ALICE, [EventIn("message", t, "user", ts=T0 + n) for n, t in enumerate(
        ["I planted tomatoes on the balcony.", "Our kitten Miso chewed the charger cable.", "The train was late again."])])
    assert mem.search_dense(ALICE, "cat damage")[0][0] == evs[1].id  # the two newest were embedded by the search
    assert [e.id for e in tenant.events.unembedded()] == [evs[0].id]
    mem.search_dense(ALICE, "gardening")  # the next search takes the rest
    assert tenant.events.unembedded() == []
    assert {i for i, _ in mem.search_dense(ALICE, "gardening")} == {e.id for e in evs}


def test_other_users_and_other_tenants_see_nothing(tenant: TenantStore, other_tenant: TenantStore, embedder: Embedder) -> None:
    mine = EpisodicMemory(tenant, embedder)
    _fill(mine, ALICE)
    assert mine.search(ALICE, "kitten named Miso", k=5)

    # Same tenant, another user of the same agent.
    assert mine.search(BOB, "kitten named Miso", k=5) == []
    assert mine.search_dense(BOB, "kitten") == []

    # Another tenant with an identically named agent and user: its scope is a different world.
    theirs = EpisodicMemory(other_tenant, embedder)
    assert theirs.search(ALICE, "kitten named Miso", k=5) == []
    assert other_tenant.events.search_text(ALICE, "kitten Miso") == []
    assert other_tenant.events.embeddings(ALICE) == []


def test_erased_user_is_never_recalled_from_a_warm_cache(tenant: TenantStore, embedder: Embedder) -> None:
    mem = EpisodicMemory(tenant, embedder)
    _fill(mem, ALICE)
    assert mem.search(ALICE, "kitten named Miso", k=3)  # the scope's vectors are now cached in this process
    assert tenant.forget_user("alice", agent="concierge") > 0
    assert mem.search(ALICE, "kitten named Miso", k=3) == []
    assert mem.search_dense(ALICE, "kitten") == []
    ev = mem.remember(ALICE, "message", "New start: I collect vintage maps.", speaker="user", ts=T0)
    assert [h.event.id for h in mem.search(ALICE, "what do I collect?", k=3)] == [ev.id]


def test_full_text_query_drops_words_found_everywhere_but_keeps_the_answer(tenant: TenantStore, embedder: Embedder) -> None:
    mem = EpisodicMemory(tenant, embedder)
    filler = [EventIn("message", f"Weekly meeting number {i} went fine.", "user", None, T0 + i) for i in range(2100)]
    tenant.events.append_many(ALICE, filler)  # lexical search needs no vectors
    target = tenant.events.append(ALICE, "message", "The meeting with the notary is on Tuesday.", speaker="user", ts=T0 + 5000)
    hits = mem.search_lexical(ALICE, "when is the meeting with the notary?", limit=5)
    assert [e.id for e, _ in hits] == [target.id]  # "meeting" (in every event) was pruned; "notary" decides
    # A query made only of common words still runs, on its rarest word.
    assert mem.search_lexical(ALICE, "weekly meeting", limit=3)


def test_hybrid_lexical_side_is_scoped_and_a_rare_word_decides(tenant: TenantStore, embedder: Embedder) -> None:
    # The hybrid search's BM25 runs on the scope's own in-process index (statistics included): another
    # user's events with the same word neither match nor change the scores.
    mem = EpisodicMemory(tenant, embedder)
    _fill(mem, ALICE)
    code = mem.remember(ALICE, "note", "Locker code for the Zanzibar storage unit is 4471.", speaker="user", ts=T0 + 86400)
    mem.remember(BOB, "note", "Zanzibar Zanzibar Zanzibar trip photos.", speaker="user", ts=T0 + 86400)
    hits = mem.search(ALICE, "Zanzibar", k=3)
    assert hits[0].event.id == code.id and hits[0].lexical_rank == 1
    assert all(h.event.scope == ALICE for h in hits)
    assert [h.lexical_rank for h in hits[1:]] == [None, None]  # only one event of Alice's has the word


def test_before_x_searches_what_came_before_the_event_naming_x(tenant: TenantStore, embedder: Embedder) -> None:
    mem = EpisodicMemory(tenant, embedder)
    log = [
        ("user", "I started a new job at Initech, the onboarding is intense."),
        ("assistant", "Good luck with the onboarding!"),
        ("user", "The supermarket was out of bread."),
        ("user", "I handed in my notice and joined Hooli on Monday."),
        ("user", "My brother read that Hooli is hiring again."),
    ]
    events = mem.remember_many(ALICE, [EventIn("message", t, s, None, T0 + 86400 * i) for i, (s, t) in enumerate(log)])
    hits = mem.search(ALICE, "Where did I work before joining Hooli?", k=3)
    assert hits[0].event.id == events[0].id
    # Everything from the anchor ("joined Hooli") on is after the time asked about.
    assert {h.event.id for h in hits}.isdisjoint({events[3].id, events[4].id})
    # Without "before" nothing is cut off: the events naming Hooli are candidates again.
    assert events[3].id in {h.event.id for h in mem.search(ALICE, "Where do I work since joining Hooli?", k=3)}


def test_first_person_question_prefers_the_users_own_turns(tenant: TenantStore, embedder: Embedder) -> None:
    mem = EpisodicMemory(tenant, embedder)
    _fill(mem, ALICE)
    said = mem.remember(ALICE, "message", "My dentist is Dr. Novak, very gentle.", speaker="user", ts=T0)
    echo = mem.remember(ALICE, "message", "Noted: your dentist is Dr. Novak. I will keep your dentist in mind.",
                        speaker="assistant", ts=T0 + 60)
    hits = mem.search(ALICE, "Who is my dentist?", k=2)
    assert [h.event.id for h in hits] == [said.id, echo.id]  # a penalty, not a filter: the echo still ranks
    neutral = EpisodicMemory(tenant, embedder, weights=FusionWeights(other_speaker_penalty=0.0))
    assert neutral.search(ALICE, "Who is my dentist?", k=1)[0].event.id == echo.id


def test_store_reads_the_cache_relies_on_stay_in_their_scope(tenant: TenantStore) -> None:
    mine = tenant.events.append_many(ALICE, [EventIn("message", f"alice {i}", "user", None, T0 + i) for i in range(5)])
    theirs = tenant.events.append(BOB, "message", "bob 0", speaker="user", ts=T0)
    more = tenant.events.append_many(ALICE, [EventIn("message", f"alice late {i}", "user", None, T0 - 10 + i) for i in range(2)])
    # get_many: an id of another scope is never returned, even when asked for by id.
    assert [e.id for e in tenant.events.get_many(ALICE, [theirs.id, mine[2].id, mine[0].id])] == [mine[2].id, mine[0].id]
    # list(after_seq): only this scope's events written after that id, in time order (backdated ones first).
    after = tenant.events.list(ALICE, after_seq=mine[-1].id, limit=100)
    assert [e.id for e in after] == [more[0].id, more[1].id]
    assert tenant.events.list(BOB, after_seq=mine[0].id, limit=100)[0].id == theirs.id


def test_searches_in_other_threads_while_events_arrive_never_fail(tenant: TenantStore, embedder: Embedder) -> None:
    # Searches read the scope's cache without its lock while another thread's search extends it.
    import threading

    mem = EpisodicMemory(tenant, embedder)
    _fill(mem, ALICE)
    errors: list[BaseException] = []
    done = threading.Event()

    def reader() -> None:
        try:
            while not done.is_set():
                mem.search(ALICE, "kitten named Miso", k=5)
                mem.search(ALICE, "what did I do before the kitchen?", k=5, speakers=["user"])
        except BaseException as e:  # noqa: BLE001 - surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    last = None
    for n in range(30):
        last = mem.remember_many(ALICE, [EventIn("message", f"Batch {n} note {j} about the garden shed.", "user", None, T0 + 10**5 + 10 * n + j)
                                         for j in range(5)])[-1]
        mem.search(ALICE, "garden shed", k=3)
    done.set()
    for t in threads:
        t.join()
    assert errors == []
    assert last.id in {h.event.id for h in mem.search(ALICE, "Batch 29 note 4 about the garden shed", k=3)}


def test_the_embedding_queue_embeds_a_tenants_pending_events_in_the_background(
        tenant: TenantStore, embedder: Embedder) -> None:
    from moorage.memory.embed_queue import EmbedQueue

    mem = EpisodicMemory(tenant, embedder)
    mem.remember_pending(ALICE, [EventIn("message", t, "user") for t in ("I planted tomatoes.", "The train was late.")])
    queue = EmbedQueue()
    try:
        queue.submit(mem)
        assert queue.wait_idle(60)
        assert tenant.events.unembedded() == []
        assert len(tenant.events.embeddings(ALICE)) == 2
    finally:
        queue.close()
    queue.submit(mem)  # closed: ignored
    assert queue.wait_idle(0)


def test_a_warm_cache_sees_events_deleted_and_as_many_written_again(tenant: TenantStore, embedder: Embedder) -> None:
    # The cache's check was the scope's event count alone: deleting n events and writing n new ones between two
    # searches left the new ones unsearchable. It now also compares the scope's highest event id.
    mem = EpisodicMemory(tenant, embedder)
    _fill(mem, ALICE)
    assert mem.search(ALICE, "kitten named Miso", k=3)  # cached in this process
    tenant.forget_user("alice", agent="concierge")
    again = mem.remember_many(ALICE, [EventIn("message", f"Fresh start number {i}: I keep bees on the roof.", "user",
                                              None, T0 + i) for i in range(len(LOG))])
    assert len(again) == len(LOG) and tenant.events.count(ALICE) == len(LOG)
    hits = mem.search(ALICE, "do I keep bees?", k=3)
    assert hits and all(h.event.id in {e.id for e in again} for h in hits)
    assert not mem.search_lexical(ALICE, "kitten Miso")


def test_a_warm_cache_follows_a_restored_branch_with_as_many_events(tenant: TenantStore, embedder: Embedder) -> None:
    # Time travel: restoring a branch brings its events back under their old ids, so the count can stay the same
    # while the highest id goes down.
    from moorage.store.repos.checkpoints import checkpoints_of

    repo = checkpoints_of(tenant)
    mem = EpisodicMemory(tenant, embedder)
    mem.remember_many(ALICE, [EventIn("message", t, s, None, T0 + i) for i, (s, t) in enumerate(LOG[:4])])
    a = repo.take("concierge", "alice", kind="manual", name="a")
    first = mem.remember_many(ALICE, [EventIn("message", "I bought a red canoe for the lake.", "user", None, T0 + 10),
                                      EventIn("message", "A canoe is lovely on a calm lake.", "assistant", None, T0 + 11)])
    b = repo.take("concierge", "alice", kind="manual", name="b")
    repo.rollback("concierge", "alice", a.id)
    second = mem.remember_many(ALICE, [EventIn("message", "I started learning the cello.", "user", None, T0 + 20),
                                       EventIn("message", "The cello is a wonderful instrument.", "assistant", None, T0 + 21)])
    assert mem.search(ALICE, "what instrument am I learning?", k=1)[0].event.id == second[0].id  # cached: 6 events
    repo.rollback("concierge", "alice", b.id)  # the canoe branch again: 6 events, the highest id lower
    assert tenant.events.count(ALICE) == 6
    hits = mem.search(ALICE, "what did I buy for the lake?", k=2)
    assert hits[0].event.id == first[0].id
    assert not any(h.event.id in {e.id for e in second} for h in mem.search(ALICE, "cello instrument", k=6))
