//! The hashers the engine picks by who chooses the keys: a fast unkeyed one for names
//! nobody outside picks, a keyed one for ids callers choose. A leaf: every module may
//! import it.

/// A fast hasher (the Fx hash of rustc) for keys nobody outside chooses: the store's
/// entity types (the schema's), the decision cache's caller buckets. Unkeyed, so never
/// for entity ids or other names a caller picks (those keep SipHash).
#[derive(Default, Clone, Copy)]
pub(crate) struct FxHasher(u64);

const FX_SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FxHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(FX_SEED);
    }
}

impl std::hash::Hasher for FxHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(c);
            self.add(u64::from_le_bytes(word));
        }
        for &b in chunks.remainder() {
            self.add(u64::from(b));
        }
    }

    fn write_u8(&mut self, n: u8) {
        self.add(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }

    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }
}

/// [`FxHasher`] for `HashMap` and `HashSet`.
pub(crate) type FastHash = std::hash::BuildHasherDefault<FxHasher>;

/// A fast hash keyed per process (foldhash, hashbrown's default), for sets of entity
/// ids, which callers choose.
pub(crate) type KeyedHash = foldhash::fast::RandomState;
