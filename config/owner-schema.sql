-- The owner database: the reference shape of the booking site's tables that
-- vacancy reads. Load into an empty database with `psql -f config/owner-schema.sql`.
-- The names are a contract: other tools load data through them. Any column added
-- later must have a default, so existing loaders keep working.

CREATE TABLE IF NOT EXISTS hotels (
    id          bigint PRIMARY KEY,
    name        text NOT NULL,
    city        text NOT NULL,
    country     text,
    stars       smallint,
    latitude    double precision,
    longitude   double precision,
    amenities   text[] NOT NULL DEFAULT '{}'
);

CREATE INDEX IF NOT EXISTS hotels_city ON hotels (lower(city));

CREATE TABLE IF NOT EXISTS room_types (
    hotel_id    bigint NOT NULL REFERENCES hotels (id),
    id          bigint NOT NULL,
    name        text NOT NULL,
    max_guests  smallint NOT NULL CHECK (max_guests > 0),
    PRIMARY KEY (hotel_id, id)
);

-- One row per hotel, room type and night: how many units exist and how many
-- are taken. Holds move units into `taken` at once (escrow). `sell_limit`
-- null means no overbooking; when set, takes check it instead of `total`.
CREATE TABLE IF NOT EXISTS inventory (
    hotel_id      bigint NOT NULL,
    room_type_id  bigint NOT NULL,
    night         date NOT NULL,
    total         int NOT NULL CHECK (total >= 0),
    taken         int NOT NULL DEFAULT 0,
    sell_limit    int,
    price_cents   int,
    PRIMARY KEY (hotel_id, room_type_id, night),
    FOREIGN KEY (hotel_id, room_type_id) REFERENCES room_types (hotel_id, id),
    CHECK (taken >= 0 AND taken <= coalesce(sell_limit, total))
);

-- A booking made by the client: the id is the client's, so a retry after a
-- lost answer hits the primary key instead of taking a second room.
CREATE TABLE IF NOT EXISTS bookings (
    id            text PRIMARY KEY,
    hotel_id      bigint NOT NULL,
    room_type_id  bigint NOT NULL,
    check_in      date NOT NULL,
    check_out     date NOT NULL,
    rooms         int NOT NULL CHECK (rooms > 0),
    status        text NOT NULL
                  CHECK (status IN ('held', 'confirmed', 'released', 'expired', 'cancelled')),
    expires_at    timestamptz,
    created_at    timestamptz NOT NULL DEFAULT now(),
    CHECK (check_out > check_in),
    FOREIGN KEY (hotel_id, room_type_id) REFERENCES room_types (hotel_id, id)
);

-- The sweeper's search: only live holds, ordered by expiry.
CREATE INDEX IF NOT EXISTS bookings_held_expiry ON bookings (expires_at) WHERE status = 'held';
