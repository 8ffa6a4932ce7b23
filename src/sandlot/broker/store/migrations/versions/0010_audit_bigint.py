"""audit ids as 64-bit integers on PostgreSQL (a 32-bit serial ends after 2**31 rows)

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-28 23:30:00

On SQLite an ``INTEGER PRIMARY KEY`` is already 64 bits: nothing changes there.
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.alter_column("audit", "id", type_=sa.BigInteger(), existing_nullable=False)
        # The serial's sequence was made ``AS integer``; as bigint its maximum follows.
        op.execute("ALTER SEQUENCE IF EXISTS audit_id_seq AS bigint")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER SEQUENCE IF EXISTS audit_id_seq AS integer")
        op.alter_column("audit", "id", type_=sa.Integer(), existing_nullable=False)
