//! The hasher of the crate's in-process maps and sets: foldhash, about a tenth of SipHash's
//! cost on short keys such as tenant and tier names. Each map draws its own random seed, so
//! names a caller chooses cannot be made to collide across processes or runs.

/// A random-seeded fast hasher, one seed per map.
pub(crate) type Seeded = foldhash::fast::RandomState;

/// `std::collections::HashMap` with [`Seeded`]: build it with `default()`.
pub(crate) type HashMap<K, V> = std::collections::HashMap<K, V, Seeded>;

/// `std::collections::HashSet` with [`Seeded`]: build it with `default()`.
pub(crate) type HashSet<K> = std::collections::HashSet<K, Seeded>;
