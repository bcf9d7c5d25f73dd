"""The PostgreSQL harness itself: a real server answers through SQLAlchemy and psycopg 3."""

from __future__ import annotations

from sqlalchemy import create_engine, text


def test_ledger_db_is_a_working_database(ledger_db: str) -> None:
    """Both ledger backends accept DDL and a transaction (the harness is not a stub)."""
    engine = create_engine(ledger_db)
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE t (x INTEGER PRIMARY KEY)"))
            conn.execute(text("INSERT INTO t VALUES (1)"))
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM t")).scalar_one() == 1
            if ledger_db.startswith("postgresql"):
                assert "PostgreSQL" in conn.execute(text("SELECT version()")).scalar_one()
    finally:
        engine.dispose()
