"""sandboxes record the host that runs them and where their dataplane answers

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-25 07:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sandboxes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("host", sa.String(length=80), nullable=True))
        batch_op.add_column(sa.Column("dataplane_http", sa.String(length=400), nullable=True))
        batch_op.add_column(sa.Column("dataplane_ws", sa.String(length=400), nullable=True))
        batch_op.create_index(batch_op.f("ix_sandboxes_host"), ["host"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("sandboxes", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_sandboxes_host"))
        batch_op.drop_column("dataplane_ws")
        batch_op.drop_column("dataplane_http")
        batch_op.drop_column("host")
