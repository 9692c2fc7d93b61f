"""Saved conversations in SQLite (`<data>/chats.sqlite`).

Every finished message is committed as soon as it exists, so killing the app never loses a turn.
The schema evolves through MIGRATIONS, applied in order and recorded in `PRAGMA user_version`.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = []


def migration(fn: Callable[[sqlite3.Connection], None]) -> Callable[[sqlite3.Connection], None]:
    MIGRATIONS.append(fn)
    return fn


@migration
def _m001_initial(db: sqlite3.Connection) -> None:
    db.execute("""CREATE TABLE conversations (
        id INTEGER PRIMARY KEY, title TEXT NOT NULL, model TEXT, settings TEXT NOT NULL DEFAULT '{}',
        created REAL NOT NULL, updated REAL NOT NULL)""")
    db.execute("""CREATE TABLE messages (
        id INTEGER PRIMARY KEY,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        role TEXT NOT NULL, content TEXT NOT NULL, created REAL NOT NULL)""")
    db.execute("CREATE INDEX messages_by_conversation ON messages(conversation_id, id)")


@migration
def _m002_message_meta(db: sqlite3.Connection) -> None:
    # model, finish reason and timings of an assistant turn
    db.execute("ALTER TABLE messages ADD COLUMN meta TEXT NOT NULL DEFAULT '{}'")


@dataclass
class Conversation:
    id: int
    title: str
    model: str | None
    settings: dict[str, Any]
    updated: float


def default_db_path() -> Path:
    from localllm.config import paths

    return paths().data / "chats.sqlite"


class History:
    def __init__(self, path: Path | str | None = None) -> None:
        path = Path(path) if path is not None else default_db_path()
        if str(path) != ":memory:":
            path.parent.mkdir(parents=True, exist_ok=True)
        # the app calls in from its event loop and from worker threads; calls are short and serialized
        self.db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA foreign_keys = ON")
        self.db.execute("PRAGMA journal_mode = WAL")
        self._migrate()

    def _migrate(self) -> None:
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        for i, step in enumerate(MIGRATIONS[version:], start=version + 1):
            with self.db:
                self.db.execute("BEGIN")
                step(self.db)
                self.db.execute(f"PRAGMA user_version = {i}")

    def close(self) -> None:
        self.db.close()

    # ---- conversations ---------------------------------------------------------------------------
    def create(self, title: str, model: str | None, settings: dict[str, Any]) -> int:
        now = time.time()
        cur = self.db.execute("INSERT INTO conversations (title, model, settings, created, updated) "
                              "VALUES (?, ?, ?, ?, ?)", (title, model, json.dumps(settings), now, now))
        return int(cur.lastrowid or 0)

    def list(self) -> list[Conversation]:
        rows = self.db.execute("SELECT id, title, model, settings, updated FROM conversations "
                               "ORDER BY updated DESC, id DESC").fetchall()
        return [Conversation(r[0], r[1], r[2], json.loads(r[3] or "{}"), r[4]) for r in rows]

    def get(self, cid: int) -> Conversation | None:
        r = self.db.execute("SELECT id, title, model, settings, updated FROM conversations WHERE id = ?",
                            (cid,)).fetchone()
        return Conversation(r[0], r[1], r[2], json.loads(r[3] or "{}"), r[4]) if r else None

    def update(self, cid: int, *, title: str | None = None, model: str | None = None,
               settings: dict[str, Any] | None = None) -> None:
        sets, args = ["updated = ?"], [time.time()]
        for col, val in (("title", title), ("model", model)):
            if val is not None:
                sets.append(f"{col} = ?")
                args.append(val)
        if settings is not None:
            sets.append("settings = ?")
            args.append(json.dumps(settings))
        self.db.execute(f"UPDATE conversations SET {', '.join(sets)} WHERE id = ?", (*args, cid))

    def delete(self, cid: int) -> None:
        self.db.execute("DELETE FROM conversations WHERE id = ?", (cid,))

    # ---- messages --------------------------------------------------------------------------------
    def add_message(self, cid: int, role: str, content: str, meta: dict[str, Any] | None = None) -> int:
        now = time.time()
        with self.db:
            self.db.execute("BEGIN")
            cur = self.db.execute("INSERT INTO messages (conversation_id, role, content, created, meta) "
                                  "VALUES (?, ?, ?, ?, ?)", (cid, role, content, now, json.dumps(meta or {})))
            self.db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, cid))
        return int(cur.lastrowid or 0)

    def messages(self, cid: int) -> list[dict[str, Any]]:
        rows = self.db.execute("SELECT role, content, meta FROM messages WHERE conversation_id = ? ORDER BY id",
                               (cid,)).fetchall()
        return [{"role": r[0], "content": r[1], "meta": json.loads(r[2] or "{}")} for r in rows]

    def delete_message(self, mid: int) -> None:
        self.db.execute("DELETE FROM messages WHERE id = ?", (mid,))

    def clear_messages(self, cid: int) -> None:
        self.db.execute("DELETE FROM messages WHERE conversation_id = ?", (cid,))

    def export_markdown(self, cid: int) -> str:
        conv = self.get(cid)
        if conv is None:
            raise KeyError(cid)
        lines = [f"# {conv.title}", ""]
        if conv.model:
            lines += [f"_model: {conv.model}_", ""]
        system = conv.settings.get("system")
        if system:
            lines += ["## System", "", system, ""]
        for m in self.messages(cid):
            # an attached image by name only: its bytes stay in the database
            images = [f"[image: {i.get('name', '?')}]" for i in m["meta"].get("images") or []]
            lines += [f"## {'You' if m['role'] == 'user' else 'Assistant'}", "", *images, m["content"], ""]
        return "\n".join(lines)
