"""browser sessions and one-time sign-in links shared by replicas

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-28 20:40:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "web_sessions",
        sa.Column("key", sa.String(length=64), nullable=False),
        sa.Column("user_id", sa.String(length=200), nullable=False),
        sa.Column("credential", sa.Text(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("last_seen", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.Column("checked_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_web_sessions")),
    )
    op.create_index(op.f("ix_web_sessions_user_id"), "web_sessions", ["user_id"])
    op.create_table(
        "web_links",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("secret_hash", sa.String(length=64), nullable=False),
        sa.Column("user_id", sa.String(length=200), nullable=False),
        sa.Column("credential", sa.Text(), nullable=True),
        sa.Column("next_path", sa.Text(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_web_links")),
    )


def downgrade() -> None:
    op.drop_table("web_links")
    op.drop_index(op.f("ix_web_sessions_user_id"), table_name="web_sessions")
    op.drop_table("web_sessions")
