//! Handles: generation-checked ids into a table, never pointers.
//!
//! Why this module exists: a C caller can pass anything as a handle — zero, a handle it
//! already closed, one it closed twice, a reader where an engine belongs, a number it
//! made up. Each of those must be refused with [`ProbityStatus::StaleHandle`], not
//! followed into freed memory. A handle is therefore an id that names a table slot and
//! the generation of the slot when the handle was issued; closing a handle bumps the
//! generation, so every copy of it goes stale at once.
//!
//! Layout of an id (64 bits): `kind` (8) | `generation` (24) | `slot + 1` (32). Zero is
//! never issued. A slot whose generation would wrap is retired rather than reused, so an
//! old handle never comes back to life.

use std::sync::{Arc, PoisonError, RwLock};

use crate::ProbityStatus;
use crate::error::Failure;

const GENERATION_BITS: u32 = 24;
const MAX_GENERATION: u32 = (1 << GENERATION_BITS) - 1;

/// What kind of object a table holds, stamped into its ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Engine = 1,
    Reader = 2,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Engine => "engine",
            Kind::Reader => "reader",
        }
    }

    fn from_tag(tag: u64) -> Option<Self> {
        match tag {
            1 => Some(Kind::Engine),
            2 => Some(Kind::Reader),
            _ => None,
        }
    }
}

struct Slot<T> {
    generation: u32,
    value: Option<Arc<T>>,
}

struct Slots<T> {
    slots: Vec<Slot<T>>,
    free: Vec<u32>,
}

/// A table of live objects of one kind. Lookups take a read lock and clone an `Arc`, so
/// a call in flight keeps its object alive even if another thread closes the handle.
pub(crate) struct Table<T> {
    kind: Kind,
    inner: RwLock<Slots<T>>,
}

impl<T> Table<T> {
    pub const fn new(kind: Kind) -> Self {
        Self {
            kind,
            inner: RwLock::new(Slots {
                slots: Vec::new(),
                free: Vec::new(),
            }),
        }
    }

    /// Stores `value` and returns its id.
    pub fn insert(&self, value: T) -> Result<u64, Failure> {
        let mut t = self.inner.write().unwrap_or_else(PoisonError::into_inner);
        let index = match t.free.pop() {
            Some(i) => i,
            None => {
                let i = u32::try_from(t.slots.len())
                    .ok()
                    .filter(|i| *i < u32::MAX)
                    .ok_or_else(|| {
                        Failure::new(
                            ProbityStatus::InvalidArgument,
                            format!("too many open {} handles", self.kind.name()),
                        )
                    })?;
                t.slots.push(Slot {
                    generation: 1,
                    value: None,
                });
                i
            }
        };
        let slot = t
            .slots
            .get_mut(index as usize)
            .ok_or_else(|| Failure::new(ProbityStatus::Internal, "handle table out of step"))?;
        slot.value = Some(Arc::new(value));
        Ok(compose(self.kind, slot.generation, index))
    }

    /// The object `id` names, if it is live.
    pub fn get(&self, id: u64) -> Result<Arc<T>, Failure> {
        let index = self.check(id)?;
        let t = self.inner.read().unwrap_or_else(PoisonError::into_inner);
        t.slots
            .get(index as usize)
            .filter(|s| s.generation == generation(id))
            .and_then(|s| s.value.clone())
            .ok_or_else(|| self.stale(id))
    }

    /// Removes the object `id` names and returns it; every copy of `id` is stale after.
    pub fn remove(&self, id: u64) -> Result<Arc<T>, Failure> {
        let index = self.check(id)?;
        let mut t = self.inner.write().unwrap_or_else(PoisonError::into_inner);
        let slot = t
            .slots
            .get_mut(index as usize)
            .filter(|s| s.generation == generation(id) && s.value.is_some())
            .ok_or_else(|| self.stale(id))?;
        let value = slot.value.take().ok_or_else(|| self.stale(id))?;
        slot.generation += 1;
        if slot.generation <= MAX_GENERATION {
            t.free.push(index);
        }
        Ok(value)
    }

    /// The slot index of a well-formed id of this table's kind.
    fn check(&self, id: u64) -> Result<u32, Failure> {
        if id == 0 {
            return Err(Failure::new(
                ProbityStatus::StaleHandle,
                format!("null {} handle (0)", self.kind.name()),
            ));
        }
        match Kind::from_tag(id >> 56) {
            Some(k) if k == self.kind => {}
            Some(other) => {
                return Err(Failure::new(
                    ProbityStatus::StaleHandle,
                    format!(
                        "handle {id:#x} is {} handle where {} handle was expected",
                        article(other),
                        article(self.kind)
                    ),
                ));
            }
            None => return Err(self.stale(id)),
        }
        let slot = (id & 0xFFFF_FFFF) as u32;
        slot.checked_sub(1).ok_or_else(|| self.stale(id))
    }

    fn stale(&self, id: u64) -> Failure {
        Failure::new(
            ProbityStatus::StaleHandle,
            format!(
                "{} handle {id:#x} is closed or was never opened",
                self.kind.name()
            ),
        )
    }
}

fn article(kind: Kind) -> &'static str {
    match kind {
        Kind::Engine => "an engine",
        Kind::Reader => "a reader",
    }
}

fn compose(kind: Kind, generation: u32, index: u32) -> u64 {
    ((kind as u64) << 56) | (u64::from(generation & MAX_GENERATION) << 32) | (u64::from(index) + 1)
}

fn generation(id: u64) -> u32 {
    ((id >> 32) as u32) & MAX_GENERATION
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_closed_handle_is_stale_and_its_slot_is_reused_under_a_new_generation() {
        let t: Table<&str> = Table::new(Kind::Engine);
        let a = t.insert("a").unwrap();
        assert_eq!(*t.get(a).unwrap(), "a");
        assert_eq!(*t.remove(a).unwrap(), "a");
        let e = t.get(a).unwrap_err();
        assert_eq!(e.status, ProbityStatus::StaleHandle);
        assert!(e.message.contains("closed"), "{}", e.message);
        // Double close.
        assert_eq!(t.remove(a).unwrap_err().status, ProbityStatus::StaleHandle);
        let b = t.insert("b").unwrap();
        assert_ne!(a, b);
        assert_eq!(a & 0xFFFF_FFFF, b & 0xFFFF_FFFF, "same slot");
        assert_eq!(t.get(a).unwrap_err().status, ProbityStatus::StaleHandle);
        assert_eq!(*t.get(b).unwrap(), "b");
    }

    #[test]
    fn null_foreign_and_made_up_handles_are_refused() {
        let engines: Table<u8> = Table::new(Kind::Engine);
        let readers: Table<u8> = Table::new(Kind::Reader);
        let r = readers.insert(1).unwrap();
        assert!(engines.get(0).unwrap_err().message.contains("null"));
        let e = engines.get(r).unwrap_err();
        assert_eq!(e.status, ProbityStatus::StaleHandle);
        assert!(e.message.contains("a reader handle"), "{}", e.message);
        for id in [1, u64::MAX, 1 << 56, (1 << 56) | 7, (1 << 56) | (1 << 32)] {
            assert_eq!(
                engines.get(id).unwrap_err().status,
                ProbityStatus::StaleHandle
            );
            assert_eq!(
                engines.remove(id).unwrap_err().status,
                ProbityStatus::StaleHandle
            );
        }
    }

    #[test]
    fn a_slot_is_retired_before_its_generation_wraps() {
        let t: Table<u8> = Table::new(Kind::Reader);
        let first = t.insert(0).unwrap();
        t.inner.write().unwrap().slots[0].generation = MAX_GENERATION;
        // The live handle was issued under generation 1: stale now.
        assert!(t.get(first).is_err());
        let last = compose(Kind::Reader, MAX_GENERATION, 0);
        t.remove(last).unwrap();
        let next = t.insert(1).unwrap();
        assert_eq!(next & 0xFFFF_FFFF, 2, "a new slot, not the retired one");
        assert!(t.get(first).is_err() && t.get(last).is_err());
    }

    #[test]
    fn a_removed_object_lives_on_for_the_calls_that_hold_it() {
        let t: Table<String> = Table::new(Kind::Engine);
        let id = t.insert("x".into()).unwrap();
        let held = t.get(id).unwrap();
        t.remove(id).unwrap();
        assert_eq!(*held, "x");
    }
}
