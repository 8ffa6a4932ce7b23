"""negotiation rate buckets in the store, shared by replicas on PostgreSQL

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25 08:10:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "rate_buckets",
        sa.Column("who", sa.String(length=200), nullable=False),
        sa.Column("tokens", sa.Float(), nullable=False),
        sa.Column("stamp", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("who"),
    )


def downgrade() -> None:
    op.drop_table("rate_buckets")
