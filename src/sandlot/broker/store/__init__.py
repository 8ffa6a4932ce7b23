"""The broker's store: SQLAlchemy Core tables, Alembic migrations, transactions."""

from sandlot.broker.store.database import Store

__all__ = ["Store"]
