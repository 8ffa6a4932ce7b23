"""tokens carry the key and the user they were minted for; revocations are indexed

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-24 18:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tokens", schema=None) as batch_op:
        batch_op.add_column(sa.Column("key_id", sa.String(length=40), nullable=True))
        batch_op.add_column(sa.Column("user_id", sa.String(length=200), nullable=True))
        batch_op.create_index(batch_op.f("ix_tokens_key_id"), ["key_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_tokens_user_id"), ["user_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_tokens_revoked_at"), ["revoked_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("tokens", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_tokens_revoked_at"))
        batch_op.drop_index(batch_op.f("ix_tokens_user_id"))
        batch_op.drop_index(batch_op.f("ix_tokens_key_id"))
        batch_op.drop_column("user_id")
        batch_op.drop_column("key_id")
