"""identities made once per store and shared by its processes (the kubernetes instance)

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-28 14:20:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "identities",
        sa.Column("name", sa.String(length=80), nullable=False),
        sa.Column("value", sa.String(length=200), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_identities")),
    )


def downgrade() -> None:
    op.drop_table("identities")
