"""Alembic environment: runs on the connection handed over by ``Store.migrate``."""

from alembic import context

from sandlot.broker.store.schema import metadata

connection = context.config.attributes.get("connection")
if connection is None:  # pragma: no cover - only used by `alembic revision --autogenerate`
    from sqlalchemy import create_engine

    url = context.config.get_main_option("sqlalchemy.url") or "sqlite://"
    connection = create_engine(url).connect()

context.configure(
    connection=connection,
    target_metadata=metadata,
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
