//! The request shapes a policy set's schema accepted, so that their later requests
//! skip Cedar's validation.

use cedar_policy_core::ast;

/// The (principal type, action, resource type) of requests with no context that the
/// schema has accepted. Validating a request reads only these three and its context,
/// so a shape accepted once is accepted again: its later requests skip Cedar's
/// validation (a sixtieth of a never-repeating decision). Bounded; past the bound,
/// requests are validated each time.
#[derive(Default)]
pub(crate) struct ValidShapes {
    accepted: std::sync::RwLock<std::collections::HashSet<Shape, crate::hashing::KeyedHash>>,
}

type Shape = (ast::EntityType, ast::EntityUID, ast::EntityType);

/// Most shapes remembered (the schema's types and actions bound them in practice).
const MAX_SHAPES: usize = 4096;

impl ValidShapes {
    /// Whether a request of this shape with no context was accepted before.
    pub fn accepted(
        &self,
        principal: &ast::EntityUID,
        action: &ast::EntityUID,
        resource: &ast::EntityUID,
    ) -> bool {
        let shape = (
            principal.entity_type().clone(),
            action.clone(),
            resource.entity_type().clone(),
        );
        self.accepted
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(&shape)
    }

    /// Remembers that a request of this shape with no context was accepted.
    pub fn accept(
        &self,
        principal: &ast::EntityUID,
        action: &ast::EntityUID,
        resource: &ast::EntityUID,
    ) {
        let mut set = self
            .accepted
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if set.len() < MAX_SHAPES {
            set.insert((
                principal.entity_type().clone(),
                action.clone(),
                resource.entity_type().clone(),
            ));
        }
    }

    /// How many shapes are remembered.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.accepted
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
    }
}
