"""sandbox hosts without the store register with an admin-issued credential (hashed)

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-28 10:40:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "host_keys",
        sa.Column("id", sa.String(length=80), nullable=False),
        sa.Column("secret_hash", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("revoked_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_host_keys")),
    )


def downgrade() -> None:
    op.drop_table("host_keys")
