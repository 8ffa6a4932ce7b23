"""sandbox hosts register in the store: provider API, dataplane URL, capacity, heartbeat

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-28 07:10:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "hosts",
        sa.Column("id", sa.String(length=80), nullable=False),
        sa.Column("provider", sa.String(length=40), nullable=False),
        sa.Column("provider_url", sa.String(length=400), nullable=True),
        sa.Column("credential", sa.String(length=200), nullable=True),
        sa.Column("dataplane_url", sa.String(length=400), nullable=False),
        sa.Column("capacity", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("heartbeat_at", sa.Float(), nullable=False),
        sa.Column("lost_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_hosts")),
    )


def downgrade() -> None:
    op.drop_table("hosts")
