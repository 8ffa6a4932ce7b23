"""a removed member's API keys cut off the scope's sandboxes

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02 07:10:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "access_cuts",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("sandbox_id", sa.String(length=40), nullable=False),
        sa.Column("key_id", sa.String(length=40), nullable=False),
        sa.Column("cut_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_access_cuts")),
    )
    op.create_index(op.f("ix_access_cuts_cut_at"), "access_cuts", ["cut_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_access_cuts_cut_at"), table_name="access_cuts")
    op.drop_table("access_cuts")
